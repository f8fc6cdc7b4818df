"""The GGUF tokenizer rebuild against the tokenizer that wrote the GGUF (tiny fixture; the real file is slow-tested)."""

from __future__ import annotations

import pytest
from fixtures.tiny_assets import SPECIALS, write_tiny_gguf

from pikv_hf.models import tokenizer_from_gguf

TEXTS = [
    "Hello world, the startup raised 2024 dollars!",
    "Café ünïcode 日本語  two spaces\tand a tab\n\nnew paragraph",
    "numbers 1234567 and 3.14159, emoji 🙂",
    "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    reference = write_tiny_gguf(path)
    return path, reference, tokenizer_from_gguf(path)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_the_tokenizer_that_wrote_the_gguf(tiny, text):
    _, reference, tok = tiny
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text).ids
    assert tok.decode(ids) == text


def test_digits_are_single_tokens_and_specials_are_atomic(tiny):
    _, reference, tok = tiny
    vocab = reference.get_vocab()
    assert tok.encode("2024", add_special_tokens=False) == [vocab["2"], vocab["0"], vocab["2"], vocab["4"]]
    for special in SPECIALS:
        assert tok.encode(special, add_special_tokens=False) == [vocab[special]]


def test_special_token_ids_and_no_automatic_bos(tiny):
    _, reference, tok = tiny
    vocab = reference.get_vocab()
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok.eos_token_id == vocab["<|im_end|>"]
    assert tok("hello").input_ids == reference.encode("hello").ids  # nothing prepended
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_gguf_tokenizers_are_rejected(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, pre="llama-bpe")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre must be one of"):
        tokenizer_from_gguf(path)
    path2 = tmp_path / "bos.gguf"
    write_tiny_gguf(path2, add_bos=True)
    with pytest.raises(ValueError, match="add_bos_token=false"):
        tokenizer_from_gguf(path2)


def test_named_models_layer_count_is_the_gguf_block_count():
    """``MODEL_LAYERS`` checks --dense-layers before a named model loads: it must be the real file's layer count."""
    import gguf

    from pikv_hf.models import find_smollm2_gguf
    from pikv_hf.models.named import MODEL_LAYERS, MODEL_NAMES

    reader = gguf.GGUFReader(str(find_smollm2_gguf()))
    blocks = int(reader.fields["llama.block_count"].contents())
    assert set(MODEL_LAYERS) == set(MODEL_NAMES) and set(MODEL_LAYERS.values()) == {blocks}  # the upcycle keeps them
