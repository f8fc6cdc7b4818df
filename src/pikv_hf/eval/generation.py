"""Model, prompt and greedy answer of the evaluation harness: model loading, the context / question token split of
kvpress's pipeline, kvpress's prefill and the answer decoded from a prefilled (possibly compressed) cache."""

from __future__ import annotations

import contextlib
import time

from pikv_hf.eval.config import EvalConfig
from pikv_hf.models.named import MODEL_NAMES


def load_model(config: EvalConfig):
    """Load the model and tokenizer named in ``config`` (offline).

    Returns
    -------
    tuple
        ``(model, tokenizer, info)`` where ``info`` describes the model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pikv_hf.models import load_named_model

    if config.model in MODEL_NAMES:
        return load_named_model(config.model, config.num_experts, config.top_k, config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    model.eval()
    info = {"name": config.model, "model_type": model.config.model_type}
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tokenizer, info


class PromptBuilder:
    """Token ids of the context part and of the question part of a prompt, as kvpress's pipeline splits them.

    With a chat template the user message is ``context + "\\n\\n" + question``; the context part ends at the context,
    the question part holds ``"\\n\\n" + question``, the end of the user turn, the assistant header and the answer
    prefix. Without a template (or when ``chat=False``) the parts are plain text, begun as the tokenizer begins a
    text (its BOS, when it adds one); a prompt meant for a chat turn then puts the answer prefix on a line of its
    own (it ran on after the question: "...text?The special magic number ... is").
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        marker = "\x00PIKV\x00"
        self.has_template = tokenizer.chat_template is not None
        if self.has_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
            )
            self.head, self.tail = rendered.split(marker)
        else:
            self.head, self.tail = tokenizer.bos_token or "", "\n"

    def reserve(self) -> int:
        """Tokens of scaffolding around context and question (chat head and tail plus the separator)."""
        return self.count(self.head) + self.count(self.tail) + self.count("\n\n")

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, context: str, question: str, answer_prefix: str, chat: bool = True, separator: str = "\n\n"):
        """Return ``(context_ids, question_ids)`` as ``[1, n]`` LongTensors.

        Parameters
        ----------
        context, question, answer_prefix : str
            Prompt pieces; the user message is ``context + separator + question``.
        chat : bool
            Use the chat template (when the tokenizer has one).
        separator : str
            Text between context and question (it starts the question part).
        """
        import torch

        plain = not (chat and self.has_template)
        if plain:  # no template: the tail is the newline before the answer (chat) or nothing (plain text asked for)
            ctx, qst = context, separator + question + (self.tail if chat else "") + answer_prefix
        else:
            ctx = self.head + context
            qst = separator + question + self.tail + answer_prefix
        encode = self.tokenizer.encode
        return (
            torch.tensor([encode(ctx, add_special_tokens=plain)]),
            torch.tensor([encode(qst, add_special_tokens=False)]),
        )


def eos_token_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def press_context(model, press):
    """``press(model)`` (the press's hooks on ``model``) when a press is given, else a context that does nothing."""
    return press(model) if press is not None else contextlib.nullcontext()


def prefill(model, context_ids, press=None, cache=None):
    """kvpress's prefill: run the context through ``model.model`` under ``with press(model):`` (when given).

    Returns
    -------
    transformers.Cache
        The (compressed) cache of the context: ``cache``, or a new ``DynamicCache``.
    """
    import torch
    from transformers import DynamicCache

    kv = DynamicCache() if cache is None else cache
    with torch.no_grad(), press_context(model, press):
        model.model(input_ids=context_ids, past_key_values=kv)
    return kv


def answer_from_cache(
    model, kv, context_len: int, question_ids, max_new_tokens: int, eos_ids: set[int], step_times: list | None = None
) -> list[int]:
    """Ask the question on a prefilled (possibly compressed) cache and decode greedily.

    Positions continue from the original context length (``context_len``), as in kvpress's pipeline, whatever
    the number of cached tokens. ``step_times``, when given, receives the wall time of each one-token decode step.

    Returns
    -------
    list of int
        Generated token ids, without the stopping eos.
    """
    import torch

    device = question_ids.device
    with torch.no_grad():
        positions = torch.arange(context_len, context_len + question_ids.shape[1], device=device).unsqueeze(0)
        logits = model(input_ids=question_ids, past_key_values=kv, position_ids=positions, logits_to_keep=1).logits
        next_pos = context_len + question_ids.shape[1]
        generated: list[int] = []
        for step in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            if token in eos_ids:
                break
            generated.append(token)
            if step + 1 == max_new_tokens:
                break
            start = time.perf_counter()
            logits = model(
                input_ids=torch.tensor([[token]], device=device),
                past_key_values=kv,
                position_ids=torch.tensor([[next_pos]], device=device),
            ).logits
            if step_times is not None:
                if logits.is_cuda:  # the step's kernels, not only their launch
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - start)
            next_pos += 1
    return generated


def answer_in_press(model, press, kv, context_ids, question_ids, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """:func:`answer_from_cache`, inside ``press``'s context when one is given (a compressor keeps compressing the
    tokens that leave its window while the answer is decoded, as kvpress's pipeline runs a decoding press)."""
    with press_context(model, press):
        return answer_from_cache(model, kv, int(context_ids.shape[1]), question_ids, max_new_tokens, eos_ids)
