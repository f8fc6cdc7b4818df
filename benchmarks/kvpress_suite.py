"""Run kvpress's own test suite twice, on ``DynamicCache`` and with a ``PiKVCache`` in its place, offline.

kvpress's tests live only in its source distribution. This script

1. downloads ``kvpress==<installed version>`` as an sdist with pip (cached under ``$PIKV_HF_CACHE`` or
   ``~/.cache/pikv_hf``, in ``kvpress_suite/``) and unpacks it;
2. builds a local stand-in for the hub model the tests load, ``MaxJeblick/llama2-0b-unit-test`` (a 2-layer Llama,
   hidden 12, 2 heads, 2 KV heads, head_dim 6, vocab 32000, random weights), with a BPE tokenizer trained here on the
   sdist's own text (Llama-style: ``<s>`` prepended, metaspace, single digits, so that the pipeline tests' sentence
   is 23 tokens as with Llama 2's tokenizer);
3. copies ``tests/`` and ``evaluation/`` into a work directory with the hub id replaced by the stand-in's path
   (``kvpress/`` itself is not copied: the installed package is tested);
4. runs pytest there once per cache with ``kvpress_suite_plugin`` (this directory), which records each test's
   outcome and, for ``pikv``, substitutes the cache;
5. writes counts, per-test outcomes and the tests that pass on ``DynamicCache`` but not on ``PiKVCache`` to
   ``--out`` (default ``benchmarks/results/kvpress_suite_cpu.json``).

Tests that need other hub models, a GPU or flash-attention fail or skip on both caches. Nothing is downloaded but
the sdist (``HF_HUB_OFFLINE=1``). ``make test-kvpress-suite`` runs it (about 3 minutes on 2 cores: 80 s per cache).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "kvpress_suite_cpu.json"
HUB_ID = re.compile(r"maxjeblick/llama2-0b-unit-test", re.IGNORECASE)
STANDIN_CONFIG = dict(
    vocab_size=32000,
    hidden_size=12,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
PROBE = ("<s>This is a test article. It was written on 2022-01-01.", 23)  # test_pipeline's context and its length
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
# Causes of "passes on DynamicCache, not on PiKVCache" as diagnosed for issue 25 (first match wins; by test id or
# message), so that a later run shows which cause a change moved. Anything unmatched is "unclassified".
CAUSES = (
    ("batch_changed:KVComposePress", None, "KVComposePress: layer 0: rewritten keys / values must be"),
    ("headwise_mask_coordinates:DMSPress", "test_dms_press_compression_ratio", None),
    ("seq_length_counts_positions", None, "get_seq_length"),
    ("seq_length_counts_positions", None, "Compressed Context Length"),
    ("answer_trimmed_by_position", "test_decoding_compression.py", "cache size"),
)


def cache_root() -> Path:
    base = os.environ.get("PIKV_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pikv_hf")
    return Path(base) / "kvpress_suite"


def fetch_sdist(root: Path, version: str) -> Path:
    """The unpacked ``kvpress-<version>`` source distribution (downloaded with pip on first use)."""
    src = root / f"kvpress-{version}"
    if (src / "tests").is_dir():
        return src
    dl = root / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    archives = glob.glob(str(dl / f"kvpress-{version}.tar.gz"))
    if not archives:
        cmd = [sys.executable, "-m", "pip", "download", f"kvpress=={version}", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*cmd, "-q", "-d", str(dl)], check=True)
        archives = glob.glob(str(dl / f"kvpress-{version}.tar.gz"))
    with tarfile.open(archives[0]) as tar:
        tar.extractall(root, filter="data")
    return src


def _corpus(src: Path) -> list[str]:
    files = sorted(glob.glob(str(src / "**" / "*.py"), recursive=True) + glob.glob(str(src / "*.md")))
    return [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]


def build_standin(src: Path, dest: Path) -> Path:
    """Save the stand-in model and tokenizer to ``dest`` (once); returns ``dest``."""
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    vocab = STANDIN_CONFIG["vocab_size"]
    tok.train_from_iterator(_corpus(src), trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials))
    # every id the model can emit decodes to some text (answers are never empty for want of a token)
    tok.add_tokens([AddedToken(f"<extra_{i}>", normalized=False) for i in range(vocab - tok.get_vocab_size())])
    bos = [("<s>", 1)]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=bos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=4096
    )
    assert fast.convert_tokens_to_ids(specials) == [0, 1, 2] and len(fast) == vocab
    n = len(fast.encode(PROBE[0], add_special_tokens=False))
    if n != PROBE[1]:
        raise RuntimeError(f"stand-in tokenizer gives {n} tokens for the pipeline tests' context, not {PROBE[1]}")
    fast.save_pretrained(tmp)
    torch.manual_seed(0)
    config = LlamaConfig(**STANDIN_CONFIG)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp)
    save_hub_data_standins(config, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def save_hub_data_standins(config, dest: Path) -> None:
    """Random per-model data that ExpectedAttentionStatsPress and QFilterPress would fetch from the hub for the real
    model (served by the plugin in place of the hub ids naming the stand-in)."""
    import torch
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats
    from kvpress.presses.qfilter_press import QFilters

    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    gen = torch.Generator().manual_seed(1)
    stats = ExpectedAttentionStats(layers, heads, head_dim, "kmfoda/booksum", "standin", 100, 1000, 4)
    a = torch.randn(layers, heads, head_dim, head_dim, generator=gen)
    with torch.no_grad():
        stats.query_mean.copy_(torch.randn(layers, heads, head_dim, generator=gen))
        stats.query_cov.copy_(a @ a.transpose(-1, -2) / head_dim)  # symmetric positive semi-definite
    stats.save_pretrained(dest / "expected_attention_stats")
    torch.manual_seed(2)
    QFilters(layers, kv_heads, head_dim).save_pretrained(dest / "qfilters")


def prepare_workdir(src: Path, work: Path, standin: Path) -> Path:
    """Fresh copy of the sdist's ``tests/`` and ``evaluation/`` with the hub id pointing at the stand-in."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in ("tests", "evaluation"):
        if (src / name).is_dir():
            shutil.copytree(src / name, work / name)
    for path in work.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        new = HUB_ID.sub(str(standin), text)
        if new != text:
            path.write_text(new, encoding="utf-8")
    (work / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return work


def run_suite(work: Path, cache: str, standin: Path, args) -> dict:
    report = work / f"report_{cache}.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), str(work), *([str(args.pikv_src)] if args.pikv_src else [])]),
        PIKV_SUITE_CACHE=cache,
        PIKV_SUITE_REPORT=str(report),
        PIKV_SUITE_PIKV_KWARGS=json.dumps(args.pikv_kwargs),
        PIKV_SUITE_STANDIN=str(standin),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "kvpress_suite_plugin", "--tb=line", *args.tests]
    if args.k:
        cmd += ["-k", args.k]
    log = work / f"pytest_{cache}.log"
    print(f"[kvpress-suite] {cache}: {' '.join(cmd[1:])} (log: {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if not report.exists():
        raise RuntimeError(f"pytest ({cache}) wrote no report (exit {proc.returncode}); see {log}")
    result = json.loads(report.read_text())
    print(f"[kvpress-suite] {cache}: {result['counts']} in {time.time() - t0:.0f} s", flush=True)
    return result


def extract_revision(rev: str, root: Path) -> tuple[Path, str]:
    """``src/pikv_hf`` of git revision ``rev`` of this checkout, extracted under ``root`` (nothing in the checkout
    changes); returns the directory to put on PYTHONPATH and the full commit id."""
    repo = HERE.parent
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True)
    sha = commit.stdout.strip()
    dest = root / "pikv_src" / sha
    if not (dest / "pikv_hf" / "__init__.py").exists():
        tmp = root / "pikv_src" / f"{sha}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", sha, "src/pikv_hf"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp), "--strip-components=1"], input=archive, check=True)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest, sha


def pikv_provenance(pikv_src: Path | None) -> dict:
    """Which pikv_hf the PiKVCache run imported: its directory and, inside a git checkout, the commit (read-only)."""
    code = "import pikv_hf, os; print(os.path.dirname(pikv_hf.__file__))"
    env = dict(os.environ, PYTHONPATH=str(pikv_src)) if pikv_src else None
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    where = proc.stdout.strip() or None
    info: dict = {"path": where, "src_option": str(pikv_src) if pikv_src else None}
    if where:
        git = ["git", "-C", where]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            dirty = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True).stdout
            info.update(commit=head.stdout.strip(), modified_files=len(dirty.splitlines()))
    return info


def summarise(results: dict[str, dict], meta: dict) -> dict:
    counts = {c: {o: r["counts"].get(o, 0) for o in OUTCOMES} for c, r in results.items()}
    ids = sorted(set().union(*(r["tests"] for r in results.values())))
    tests = {}
    for nid in ids:
        row = {}
        for c, r in results.items():
            rec = r["tests"].get(nid, {"outcome": "absent", "message": ""})
            row[c] = rec["outcome"]
            if rec["outcome"] not in ("passed", "xfailed") and rec["message"]:
                row[f"{c}_message"] = rec["message"][:600]
            if rec.get("restored"):
                row[f"{c}_restored"] = rec["restored"]
        tests[nid] = row
    regressions = []
    if {"dynamic", "pikv"} <= results.keys():
        regressions = [n for n, row in tests.items() if row["dynamic"] == "passed" and row["pikv"] != "passed"]
    causes: dict[str, list[str]] = {}
    for nid in regressions:
        msg = tests[nid].get("pikv_message", "")
        cause = next(
            (c for c, in_id, in_msg in CAUSES if (in_id is None or in_id in nid) and (in_msg is None or in_msg in msg)),
            "unclassified",
        )
        causes.setdefault(cause, []).append(nid)
    return {
        **meta,
        "counts": counts,
        "seconds": {c: r["seconds"] for c, r in results.items()},
        "patched_modules": results.get("pikv", {}).get("patched_modules"),
        "pass_on_dynamic_not_on_pikv": len(regressions),
        "regressions_by_cause": {c: len(v) for c, v in causes.items()},
        "regressions": causes,
        "tests": tests,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=importlib.metadata.version("kvpress"), help="kvpress version (installed)")
    ap.add_argument("--caches", nargs="+", default=["dynamic", "pikv"], choices=["dynamic", "pikv"])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--pikv-kwargs", type=json.loads, default={}, help="JSON dict of PiKVCache keyword arguments")
    ap.add_argument(
        "--pikv-src",
        type=Path,
        help="directory holding the pikv_hf package to test, put first on PYTHONPATH (default: the installed one)",
    )
    ap.add_argument(
        "--pikv-rev",
        help="test the pikv_hf of this git revision of the checkout (extracted read-only with git archive), e.g. HEAD",
    )
    ap.add_argument("-k", help="pytest -k expression (a subset; the JSON then covers only it)")
    ap.add_argument("tests", nargs="*", default=["tests"], help="paths inside the sdist (default: tests)")
    args = ap.parse_args(argv)

    root = cache_root()
    rev = None
    if args.pikv_rev:
        args.pikv_src, rev = extract_revision(args.pikv_rev, root)
    src = fetch_sdist(root, args.version)
    standin = build_standin(src, root / "llama2-0b-unit-test-standin")
    work = prepare_workdir(src, root / "work", standin)
    results = {c: run_suite(work, c, standin, args) for c in args.caches}
    import tokenizers
    import torch
    import transformers

    meta = {
        "what": "kvpress's own tests (sdist) on DynamicCache and with PiKVCache substituted for it, offline stand-in",
        "kvpress": args.version,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "standin": {"replaces": "MaxJeblick/llama2-0b-unit-test", "config": STANDIN_CONFIG, "seed": 0},
        "pikv_kwargs": args.pikv_kwargs,
        "pikv_hf": {**pikv_provenance(args.pikv_src), **({"revision": rev} if rev else {})},
        "selection": {"paths": args.tests, "k": args.k},
    }
    summary = summarise(results, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[kvpress-suite] counts: {json.dumps(summary['counts'])}")
    print(f"[kvpress-suite] pass on DynamicCache, not on PiKVCache: {summary['pass_on_dynamic_not_on_pikv']}")
    print(f"[kvpress-suite] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
