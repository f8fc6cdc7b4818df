"""pytest plugin of ``benchmarks/kvpress_suite.py``: records every test's outcome and, with
``PIKV_SUITE_CACHE=pikv``, hands kvpress's tests a ``PiKVCache`` wherever they build a ``DynamicCache``.

Loaded with ``-p kvpress_suite_plugin`` (``benchmarks/`` on ``PYTHONPATH``). Environment:

* ``PIKV_SUITE_REPORT``: path of the JSON report written at the end of the session (per-test outcome and message).
* ``PIKV_SUITE_CACHE``: ``dynamic`` (default: nothing is patched) or ``pikv``.
* ``PIKV_SUITE_PIKV_KWARGS``: JSON object of ``PiKVCache`` keyword arguments (default ``{}``).
* ``PIKV_SUITE_STANDIN``: the stand-in model directory (its config sizes a cache that never meets a model; its
  ``expected_attention_stats/`` and ``qfilters/`` stand in for the hub data of ExpectedAttentionStatsPress and
  QFilterPress, both runs).

Both runs: a test that leaves a model in another dtype than float32 (kvpress's ``test_half_precision_no_nan`` casts
the session's model to float16 and casts it back only if it passes) gets it cast back afterwards, and its record
says so (``restored``), so that one failure does not cascade into the tests after it.

Substitution (``pikv``): ``transformers.DynamicCache`` and the ``DynamicCache`` global of every ``tests.*`` and
``kvpress.*`` module (kvpress's pipeline builds one when given no cache) become ``PiKVInPlaceOfDynamicCache``, whose
constructor returns a ``PiKVCache``. A ``PiKVCache`` needs its model, which ``DynamicCache()`` does not name: the
cache is first built on the stand-in's config, and a forward pre-hook on every ``PreTrainedModel`` rebuilds it on
the model it is first given to (``PiKVCache(model)``, which also switches that model to the ``pikv`` attention) while
it is still empty. transformers' own ``generate`` keeps building ``DynamicCache`` (its module is not patched).
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref

import pytest

MODE = os.environ.get("PIKV_SUITE_CACHE", "dynamic")
UNBOUND = "_pikv_suite_unbound"  # marks a substitute cache not yet rebuilt on its model
OUTER = "_pikv_suite_outer"  # inner base model -> weakref of the causal LM that holds it

_results: dict[str, dict] = {}
_patched_modules: list[str] = []
_real_dynamic = None


def _pikv_kwargs() -> dict:
    return json.loads(os.environ.get("PIKV_SUITE_PIKV_KWARGS") or "{}")


def _standin() -> str:
    return os.environ["PIKV_SUITE_STANDIN"]


def _default_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_standin())


_models: weakref.WeakSet = weakref.WeakSet()  # every PreTrainedModel built in the session


def _install_model_tracking() -> None:
    from transformers import PreTrainedModel

    original_post_init = PreTrainedModel.post_init

    def post_init(self):
        original_post_init(self)
        _models.add(self)
        for sub in self.modules():
            if sub is not self and isinstance(sub, PreTrainedModel):
                object.__setattr__(sub, OUTER, weakref.ref(self))
        if MODE == "pikv":
            self.register_forward_pre_hook(_bind_hook, with_kwargs=True)

    PreTrainedModel.post_init = post_init


def _install_hub_data_standins() -> None:
    """ExpectedAttentionStatsPress and QFilterPress load per-model data from the hub: serve the stand-in's."""
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats
    from kvpress.presses.qfilter_press import QFilters

    name = os.path.basename(_standin())
    for cls, folder in ((ExpectedAttentionStats, "expected_attention_stats"), (QFilters, "qfilters")):
        original = cls.from_pretrained.__func__

        def from_pretrained(klass, model_id, *args, _original=original, _folder=folder, **kwargs):
            if name in str(model_id):
                model_id = os.path.join(_standin(), _folder)
            return _original(klass, model_id, *args, **kwargs)

        cls.from_pretrained = classmethod(from_pretrained)


class _SubstituteMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        from pikv_hf import PiKVCache

        return isinstance(obj, (_real_dynamic, PiKVCache))

    def __subclasscheck__(cls, sub) -> bool:
        from pikv_hf import PiKVCache

        return issubclass(sub, (_real_dynamic, PiKVCache))


class PiKVInPlaceOfDynamicCache(metaclass=_SubstituteMeta):
    """``DynamicCache(...)`` in the tests' namespaces: returns a ``PiKVCache`` (bound to its model on first use)."""

    def __new__(cls, *args, config=None, **kwargs):
        from pikv_hf import PiKVCache

        if args or kwargs.get("ddp_cache_data") is not None:
            raise TypeError("the kvpress suite substitute takes no initial cache data")
        cache = PiKVCache(config if config is not None else _default_config(), **_pikv_kwargs())
        setattr(cache, UNBOUND, True)
        return cache


def _outer_model(model):
    ref = getattr(model, OUTER, None)
    outer = ref() if ref is not None else None
    return outer if outer is not None else model


def _bind_hook(module, args, kwargs):
    """Forward pre-hook: rebuild an unbound substitute cache on the model it is given to (still empty)."""
    cache = kwargs.get("past_key_values")
    if cache is None or not getattr(cache, UNBOUND, False):
        return None
    from pikv_hf import PiKVCache

    if cache.get_seq_length() != 0:
        raise RuntimeError("kvpress suite: a substitute PiKVCache received tokens before meeting its model")
    fresh = PiKVCache(_outer_model(module), **_pikv_kwargs())
    cache.__dict__.clear()
    cache.__dict__.update(fresh.__dict__)
    return None


def _install_substitution() -> None:
    global _real_dynamic
    import transformers
    from transformers.cache_utils import DynamicCache

    import pikv_hf  # noqa: F401  (registers the pikv attention and kvpress glue, imports kvpress)

    _real_dynamic = DynamicCache
    transformers.DynamicCache = PiKVInPlaceOfDynamicCache
    _patch_module_globals()


def _patch_module_globals() -> None:
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "tests" or name.startswith(("tests.", "kvpress"))):
            continue
        if getattr(mod, "DynamicCache", None) is _real_dynamic:
            mod.DynamicCache = PiKVInPlaceOfDynamicCache
            _patched_modules.append(name)


def pytest_configure(config) -> None:
    config._pikv_suite_start = time.time()
    if MODE not in ("dynamic", "pikv"):
        raise pytest.UsageError(f"PIKV_SUITE_CACHE must be 'dynamic' or 'pikv', got {MODE!r}")
    _install_model_tracking()
    if MODE == "pikv":  # first: pikv_hf registers its attention before kvpress is imported, as its docs require
        _install_substitution()
    _install_hub_data_standins()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    import torch

    restored = []
    for model in list(_models):
        if getattr(model, OUTER, None) is None and model.dtype != torch.float32:
            restored.append(f"{type(model).__name__} {model.dtype} -> float32")
            model.float()
    if restored:
        _results.setdefault(item.nodeid, {"outcome": "passed", "message": "", "duration": 0.0})["restored"] = restored


def pytest_collection_finish(session) -> None:
    if MODE == "pikv":  # modules imported during collection that bound the real class before the patch
        _patch_module_globals()


def _message(report) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return f"{crash.message}  [{os.path.basename(crash.path)}:{crash.lineno}]"
    if isinstance(report.longrepr, tuple):  # skips: (path, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr or "")[-2000:]


def pytest_runtest_logreport(report) -> None:
    rec = _results.setdefault(report.nodeid, {"outcome": "passed", "message": "", "duration": 0.0})
    rec["duration"] = round(rec["duration"] + report.duration, 3)
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            rec["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.outcome != "passed":
            rec["outcome"] = report.outcome
        if report.outcome != "passed":
            rec["message"] = _message(report)
    elif report.outcome == "skipped":
        rec["outcome"] = "xfailed" if xfail else "skipped"
        rec["message"] = _message(report)
    elif report.outcome == "failed":
        rec["outcome"] = "error"
        rec["message"] = f"{report.when}: {_message(report)}"


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("PIKV_SUITE_REPORT")
    if not path:
        return
    counts: dict[str, int] = {}
    for rec in _results.values():
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    report = {
        "cache": MODE,
        "pikv_kwargs": _pikv_kwargs() if MODE == "pikv" else None,
        "patched_modules": sorted(set(_patched_modules)),
        "exitstatus": int(exitstatus),
        "seconds": round(time.time() - session.config._pikv_suite_start, 1),
        "counts": dict(sorted(counts.items())),
        "tests": _results,
    }
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
