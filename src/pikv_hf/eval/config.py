"""Arguments of an evaluation run: ``EvalConfig`` (checks, points, PiKVCache read settings, output fingerprint), the
press names it accepts (kvpress's and pikv_hf's) and the tasks and data it resolves to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pikv_hf.checks import check_int_at_least, check_seed
from pikv_hf.config import ReadConfig
from pikv_hf.eval.pikv_presses import PIKV_PRESSES, ROUTED_SUFFIX, sparse_read
from pikv_hf.models.named import MODEL_LAYERS, MODEL_NAMES
from pikv_hf.routing.expert import num_experts_of
from pikv_hf.store.paged import check_num_shards, check_page_size

CACHES = ("dynamic", "pikv")
ROUTERS = ("round_robin", "expert", "key_cluster")
SUITES = ("ruler", "longbench")
ABSTRACT_PRESSES = ("ScorerPress",)  # base classes without a scoring rule
PIKV_MODES = {"pikv_routed": "routed", "pikv_quest": "quest"}  # decode attention modes of PiKVCache (--cache pikv)


@dataclass
class EvalConfig:
    """Arguments of one evaluation run (also written to ``metrics.json``).

    Attributes
    ----------
    suite : str
        ``ruler`` or ``longbench``.
    model : str
        ``smollm2``, ``smollm2-moe`` or a ``save_pretrained`` directory.
    presses : list of str
        ``none`` and/or kvpress press names (see :func:`press_names`); with ``cache="pikv"``: ``none`` (exact),
        ``pikv_routed`` and/or ``pikv_quest``.
    ratios : list of float
        Compression ratios in [0, 1) for the presses (``none`` runs once, at ratio 0); for ``pikv_routed`` /
        ``pikv_quest`` the fraction of KV pages a decode step skips.
    out : str
        Output directory.
    cache : str
        ``dynamic`` (kvpress's flow) or ``pikv`` (PiKVCache).
    router : str
        PiKVCache placement router.
    num_shards : int or None
        PiKVCache shards per layer and KV head (default: the model's experts, or 8 for a dense model).
    page_size : int
        PiKVCache tokens per page.
    read : ReadConfig
        Read options of ``pikv_routed`` / ``pikv_quest`` (``selector``, ``n_sink``, ``window``, ``dense_layers``,
        ``mass_target``; see ``pikv_hf.config.ReadConfig``); each point sets the mode and its
        ``top_k_shards`` / ``read_fraction`` from the ratio.
    samples : int
        Samples per task (and per length, press and ratio).
    lengths : list of int
        RULER prompt lengths, or LongBench truncation lengths (each evaluated in turn).
    tasks : str
        RULER tasks/groups or LongBench datasets, comma-separated.
    seed : int
        Seed of the RULER generators and of the upcycling k-means.
    num_experts, top_k : int
        Upcycling of ``smollm2-moe``.
    longbench_dir : str or None
        Local LongBench JSONL directory (otherwise ``THUDM/LongBench`` through ``datasets``).
    perplexity_context : int
        When > 0: per point, the perplexity of ``perplexity_tokens`` held-out essay tokens after a context of this
        many held-out tokens, compressed as the point compresses.
    perplexity_tokens : int
        Tokens scored for the perplexity.
    """

    suite: str
    model: str
    presses: list[str]
    ratios: list[float]
    out: str
    cache: str = "dynamic"
    router: str = "round_robin"
    num_shards: int | None = None
    page_size: int = 16
    read: ReadConfig = field(default_factory=ReadConfig)
    samples: int = 20
    lengths: list[int] = field(default_factory=lambda: [2048])
    tasks: str = "needle"
    seed: int = 0
    num_experts: int = 8
    top_k: int = 2
    longbench_dir: str | None = None
    perplexity_context: int = 0
    perplexity_tokens: int = 256

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the parameter and the expected values."""
        if self.suite not in SUITES:
            raise ValueError(f"suite must be one of {SUITES}, got {self.suite!r}")
        if not isinstance(self.out, str) or not self.out.strip():
            raise ValueError(f"out must name an output directory, got {self.out!r}")
        # a PATH model: a save_pretrained directory with a readable config.json and weights
        text_config = None if self.model in MODEL_NAMES else self.model_config()
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        moe = self.is_moe() if text_config is None else num_experts_of(text_config) is not None
        if self.cache == "pikv" and self.router == "expert" and not moe:
            raise ValueError(
                f"router 'expert' places tokens by the model's MoE routing and model {self.model!r} has no experts: "
                "use --router key_cluster (placement by key similarity) or round_robin"
            )
        if not self.presses:
            raise ValueError("press must name at least one press ('none' for no compression)")
        from pikv_hf.eval import compression

        for press in self.presses:
            if compression.is_compression(press):
                compression.build(press)  # its settings checked now, before the model loads
        others = [p for p in self.presses if p != "none" and not compression.is_compression(p)]
        if any(press not in (*PIKV_MODES, *PIKV_PRESSES) for press in others):
            known = press_names()  # kvpress is imported only when one of its presses is asked for
            for press in others:
                if press not in (*PIKV_MODES, *PIKV_PRESSES, *known):
                    raise ValueError(
                        f"press must be 'none', one of {sorted(PIKV_PRESSES)}, a compression spec "
                        f"({', '.join(compression.COMPRESSORS)}, {compression.QUANTIZED_CACHE}) or a kvpress press "
                        f"{sorted(known)}, got {press!r}"
                    )
        for press in others:
            if self.cache != "pikv" and (press in PIKV_MODES or press.endswith(ROUTED_SUFFIX)):
                raise ValueError(f"press {press!r} reads a PiKVCache at decode time: it needs --cache pikv")
        if not self.ratios:
            raise ValueError("ratio must be given at least once")
        keyed: dict[str, float] = {}
        for ratio in self.ratios:
            if not 0.0 <= ratio < 1.0:
                raise ValueError(f"ratio must be in [0, 1), got {ratio}")
            other = keyed.setdefault(f"{ratio:g}", ratio)  # a point's results are keyed by the ratio's 6 digits
            if other != ratio:
                raise ValueError(f"ratio values {other} and {ratio} are one point to 6 significant digits: give one")
        if self.num_shards is not None:
            check_num_shards(self.num_shards)
        check_seed(self.seed)
        check_page_size(self.page_size)
        layers = MODEL_LAYERS[self.model] if text_config is None else text_config.num_hidden_layers
        self.read.validated(None, layers)  # also for runs that never build a sparse point (dynamic cache, ...)
        if self.cache != "pikv":
            pikv_only = {
                "router": self.router != "round_robin",
                "num_shards": self.num_shards is not None,
                "page_size": self.page_size != 16,
                "the read options (selector, n_sink, window, dense_layers, mass_target, sparse_from)": (
                    self.read != ReadConfig()
                ),
            }
            given = [name for name, changed in pikv_only.items() if changed]
            if given:
                given = ", ".join(given)
                raise ValueError(f"{given} configure a PiKVCache: they need cache 'pikv', got {self.cache!r}")
        if self.cache == "pikv":
            shards = self.shards()
            for press, ratio in self.points():
                if press in ("pikv_quest", "pikv_routed"):
                    self.point_read(press, ratio, shards).validated(shards, None)
            routed = any(p == "pikv_routed" or p.endswith(ROUTED_SUFFIX) for p in self.presses)
            if self.read.mass_target is not None and not routed:
                raise ValueError(
                    f"mass_target applies to routed reads only: it needs press pikv_routed or *{ROUTED_SUFFIX}, got "
                    f"{self.presses}"
                )
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ValueError(f"length must be >= 64 tokens, got {self.lengths}")
        if self.num_experts < 2 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts must be >= 2 and top_k in [1, num_experts], got {self.num_experts}, {self.top_k}"
            )
        upcycling = self._given("num_experts", "top_k")
        if upcycling and self.model != "smollm2-moe":
            raise ValueError(
                f"{', '.join(upcycling)} upcycle smollm2-moe: they need model 'smollm2-moe', got {self.model!r}"
            )
        if self.longbench_dir is not None and not Path(self.longbench_dir).is_dir():
            raise ValueError(f"longbench_dir must be an existing directory, got {self.longbench_dir!r}")
        if self.longbench_dir is not None and self.suite != "longbench":
            raise ValueError(f"longbench_dir holds LongBench data: it needs suite 'longbench', got {self.suite!r}")
        check_int_at_least("perplexity_context", self.perplexity_context, 0)
        check_int_at_least("perplexity_tokens", self.perplexity_tokens, 2)
        if self._given("perplexity_tokens") and self.perplexity_context == 0:
            raise ValueError(
                f"perplexity_tokens is scored after perplexity_context tokens: it needs perplexity_context > 0 "
                f"(0: no perplexity), got perplexity_tokens {self.perplexity_tokens}"
            )

    def _given(self, *names: str) -> list[str]:
        """Those of the fields ``names`` whose value is not the field's default (options a command line gave)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in names if getattr(self, name) != defaults[name]]

    def model_config(self):
        """The text config of a ``PATH`` model (its ``config.json``); ``ValueError`` naming ``model`` unless the
        directory holds a config transformers reads and weights."""
        from transformers import AutoConfig

        path, expected = Path(self.model), f"one of {MODEL_NAMES} or a save_pretrained directory"
        if not self.model or not path.is_dir():
            raise ValueError(f"model must be {expected}, got {self.model!r}")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ValueError(f"model must be {expected}: {self.model!r} holds no weights (*.safetensors, *.bin)")
        try:
            return AutoConfig.from_pretrained(path).get_text_config()
        except (OSError, ValueError, KeyError) as err:
            reason = " ".join(str(err).split())[:300]
            message = f"model must be {expected}: {self.model!r} has no readable config.json ({reason})"
            raise ValueError(message) from None

    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts (for a ``PATH`` model: its ``config.json``, read here)."""
        if self.model in MODEL_NAMES:
            return self.model == "smollm2-moe"
        return num_experts_of(self.model_config()) is not None

    def shards(self) -> int:
        """PiKVCache's shard count: ``num_shards``, else the model's experts (a ``PATH`` model: its
        ``config.json``), else ``PiKVCache``'s default for a dense model."""
        from pikv_hf.cache import DEFAULT_DENSE_SHARDS

        if self.num_shards is not None:
            return self.num_shards
        if self.model in MODEL_NAMES:
            return self.num_experts if self.model == "smollm2-moe" else DEFAULT_DENSE_SHARDS
        return num_experts_of(self.model_config()) or DEFAULT_DENSE_SHARDS

    def point_read(self, press: str, ratio: float, shards: int) -> ReadConfig:
        """The ``ReadConfig`` of a ``--cache pikv`` point: ``none`` exact, ``pikv_routed``
        ``top_k_shards = (1 - ratio) * shards`` (a whole number in ``[1, shards]``), ``pikv_quest``
        ``read_fraction = 1 - ratio``; sparse points read sparsely from the first decode step unless
        ``--sparse-from`` is given (:func:`sparse_read`)."""
        if press == "none":
            return dataclasses.replace(self.read, attention="exact")
        if press == "pikv_quest":
            return sparse_read(self.read, attention="quest", read_fraction=1.0 - ratio, mass_target=None)
        k = round((1.0 - ratio) * shards)
        if k < 1 or abs((1.0 - ratio) * shards - k) > 1e-6:
            raise ValueError(
                f"ratio {ratio} with pikv_routed must skip a whole number of the {shards} shards and keep at least "
                f"one, i.e. ratio in {{j / {shards} : j = 0 .. {shards - 1}}}"
            )
        return sparse_read(self.read, attention="routed", top_k_shards=k)

    def points(self) -> list[tuple[str, float]]:
        """(press, ratio) pairs to run: ``none`` and compression specs once at ratio 0, every other press at every
        ratio."""
        from pikv_hf.eval.compression import is_compression

        out: list[tuple[str, float]] = []
        for press in self.presses:
            for ratio in [0.0] if press == "none" or is_compression(press) else self.ratios:
                if (press, ratio) not in out:
                    out.append((press, ratio))
        return out

    def fingerprint(self) -> dict:
        """Fields that must match for two runs to share an output directory."""
        return {
            "suite": self.suite,
            "model": self.model,
            "cache": self.cache,
            "router": self.router if self.cache == "pikv" else None,
            "pikv": self._pikv_fingerprint() if self.cache == "pikv" else None,
            "seed": self.seed,
            "num_experts": self.num_experts if self.model == "smollm2-moe" else None,
            "top_k": self.top_k if self.model == "smollm2-moe" else None,
            "longbench_dir": self.longbench_dir,
        }

    def _pikv_fingerprint(self) -> list:
        """PiKVCache settings; the later options only when set, so directories of earlier runs still resume."""
        read = self.read
        extra = {"page_size": (self.page_size, 16), "dense_layers": (read.dense_layers, 0)}
        extra["mass_target"] = (read.mass_target, None)
        extra["sparse_from"] = (read.sparse_from, None)
        later = [f"{name}={value}" for name, (value, default) in extra.items() if value != default]
        return [self.num_shards, read.selector, read.n_sink, read.window, *later]


def press_names() -> dict[str, str]:
    """kvpress presses usable with ``--press``: snake_case alias -> class name.

    Only dataclass presses whose constructor takes ``compression_ratio`` and has a default for every other argument
    qualify (the harness sets the ratio; wrappers such as AdaKVPress or CriticalKVPress that need an inner press do
    not).

    Returns
    -------
    dict
        Aliases -> class name: the lower-cased name without ``Press`` (``snapkv``, ``streamingllm``), its snake case
        (``snap_kv``, ``streaming_llm``, ``expected_attention``) and the class name itself.
    """
    import inspect
    import re

    import kvpress

    out: dict[str, str] = {}
    for name in kvpress.__all__:
        cls = getattr(kvpress, name)
        if name in ABSTRACT_PRESSES or not (
            isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("Press")
        ):
            continue
        params = inspect.signature(cls).parameters  # the constructor's, which a press may write itself
        if "compression_ratio" not in params or any(p.default is p.empty for p in params.values()):
            continue
        base = name[: -len("Press")]
        out[base.lower()] = name
        out[re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()] = name
        out[name] = name
    return out


def build_press(name: str, ratio: float, heads: str | None = None):
    """Instantiate a kvpress press or one of pikv_hf's (``pikv_*``), or return None for ``none``.

    Parameters
    ----------
    name : str
        Alias or class name from :func:`press_names`, a name of ``PIKV_PRESSES``, or ``none``.
    ratio : float
        ``compression_ratio`` in [0, 1).
    heads : str, optional
        DuoAttention head scores (``pikv_duo_attention``).

    Returns
    -------
    kvpress.BasePress or None
    """
    if name == "none":
        return None
    if name in PIKV_PRESSES:
        from pikv_hf.eval.pikv_presses import build_pikv_press

        return build_pikv_press(name, ratio, heads)
    names = press_names()
    if name not in names:
        raise ValueError(f"press must be 'none' or one of {sorted(names)}, got {name!r}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    import kvpress

    return getattr(kvpress, names[name])(compression_ratio=ratio)


def resolve_inputs(config: EvalConfig) -> tuple[list[str], dict | None]:
    """Validate ``config`` and resolve what it asks for, before anything is written or loaded.

    Returns
    -------
    tuple
        ``(tasks, longbench_rows)``: the task (or LongBench dataset) names, and for LongBench the rows of each dataset
        (``None`` for RULER). Raises ``ValueError`` (bad arguments) or ``RuntimeError`` (data that cannot be loaded).
    """
    config.validate()
    if config.suite == "ruler":
        from pikv_hf.eval.ruler import resolve_tasks

        return resolve_tasks(config.tasks), None
    from pikv_hf.eval import longbench

    tasks = longbench.resolve_datasets(config.tasks)
    return tasks, {t: longbench.load_dataset_rows(t, config.longbench_dir) for t in tasks}
