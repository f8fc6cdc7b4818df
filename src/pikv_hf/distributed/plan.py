"""``ShardPlan``: which partition holds each shard of every layer, and where the partitions are.

A plan is the same for every layer and every (batch row, KV head): shard ``s`` of any layer lives in partition
``owner[s]``. Partitions are either

* **devices of one process** (``for_devices``, ``from_accelerate``): every partition is a page pool on its device,
  all held by this process;
* **ranks** (``for_ranks``): partition ``r`` belongs to rank ``r`` of a ``torch.distributed`` process group and
  this process holds partition ``rank`` only, on the device its keys arrive on.

Plans are plain data, checked when built; ``pikv_hf.distributed.partition`` turns one into the storage and the
attention of a cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pikv_hf.checks import check_int_at_least

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 7 * 86400.0  # a week: far beyond any collective, well inside what the backends' timers hold


def check_device(device: str | int | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this process can use; ``ValueError`` naming it and what is visible if not."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"placement map names device {device!r}, which is not a torch device: {err}") from None
    if dev.type in ("cpu", "meta"):
        if dev.type == "meta":
            raise ValueError("placement map names device 'meta', which holds no data; name a real device")
        return dev
    module = getattr(torch, dev.type, None)
    available = module.device_count() if module is not None and module.is_available() else 0
    index = dev.index if dev.index is not None else 0
    if index >= available:
        raise ValueError(
            f"placement map names device {str(dev)!r}, but this process sees {available} {dev.type} device(s)"
            + (f" ({dev.type}:0 .. {dev.type}:{available - 1})" if available else "")
        )
    return torch.device(dev.type, index)


def split_shards(num_shards: int, weights: Mapping[str, float]) -> dict[int, str]:
    """``{shard: device}``: contiguous blocks of shards, sized in proportion to ``weights`` (largest remainder;
    ties go to the earlier device). Devices whose share rounds to no shard are left out."""
    check_int_at_least("num_shards", num_shards, 1)
    values = list(weights.values())
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in values)
    if not values or not numbers or sum(values) <= 0 or any(w < 0 for w in values):
        raise ValueError(
            f"weights must hold finite numbers, at least one positive and no negative one, got {dict(weights)}"
        )
    total = float(sum(values))
    exact = {d: num_shards * w / total for d, w in weights.items()}
    count = {d: int(e) for d, e in exact.items()}
    by_remainder = sorted(weights, key=lambda d: -(exact[d] - count[d]))  # stable: ties keep the device order
    for d in by_remainder[: num_shards - sum(count.values())]:
        count[d] += 1
    owner, s = {}, 0
    for d in weights:
        for _ in range(count[d]):
            owner[s] = d
            s += 1
    return owner


def _accelerator_type() -> str:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return acc.type if acc is not None else "cuda"


@dataclass(frozen=True)
class ShardPlan:
    """Shard -> partition -> device (and rank). Build one with a classmethod.

    Attributes
    ----------
    owner : tuple of int
        ``[S]`` partition of every shard.
    devices : tuple of (str or None)
        Device of every partition; None: the device the layer's keys arrive on (each rank's own device).
    rank, world_size : int
        With ``world_size > 1`` partition ``p`` belongs to rank ``p`` and this process holds partition ``rank``.
    timeout : float
        Seconds any collective may take before it raises (ranks only).
    group : torch.distributed.ProcessGroup, optional
        Process group of the ranks (default: the world).
    """

    owner: tuple[int, ...]
    devices: tuple[str | None, ...]
    rank: int = 0
    world_size: int = 1
    timeout: float = DEFAULT_TIMEOUT_S
    group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.devices, (str, torch.device)) or not isinstance(self.devices, (tuple, list)):
            raise ValueError(f"devices must be a sequence of devices, one per partition, got {self.devices!r}")
        n = len(self.devices)
        ints = all(isinstance(p, int) and not isinstance(p, bool) for p in self.owner)
        if not self.owner or not ints or any(not 0 <= p < n for p in self.owner):
            raise ValueError(
                f"owner must name a partition in [0, {n}) for each of at least one shard, got {self.owner}"
            )
        empty = sorted(set(range(n)) - set(self.owner))
        if empty:
            raise ValueError(f"partitions {empty} own no shard; every partition must own at least one")
        check_int_at_least("world_size", self.world_size, 1)
        if self.world_size > 1 and n != self.world_size:
            raise ValueError(
                f"a plan over ranks needs one partition per rank: {n} partitions, world_size {self.world_size}"
            )
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={self.world_size}), got {self.rank!r}")
        t = self.timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {t!r}")
        for p in self.local_partitions:  # a plan built by hand: its devices are checked as the classmethods' are
            if self.devices[p] is not None:
                check_device(self.devices[p])

    @property
    def num_shards(self) -> int:
        return len(self.owner)

    @property
    def local_partitions(self) -> tuple[int, ...]:
        """The partitions this process holds: all of them in one process, its own with ranks."""
        return (self.rank,) if self.world_size > 1 else tuple(range(len(self.devices)))

    def shards_of(self, partition: int) -> list[int]:
        return [s for s, p in enumerate(self.owner) if p == partition]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def for_ranks(
        cls,
        num_shards: int,
        world_size: int | None = None,
        rank: int | None = None,
        *,
        group: object = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> ShardPlan:
        """Rank ``r`` of ``world_size`` owns the contiguous block of ``num_shards / world_size`` shards starting at
        ``r * num_shards / world_size`` (as expert parallelism places experts: with ``router="expert"`` the KV of a
        block of experts sits on the rank that holds those experts). ``world_size`` must divide ``num_shards``, so
        every rank holds the same share of the KV. ``world_size`` / ``rank`` default to the initialised process
        group's."""
        check_int_at_least("num_shards", num_shards, 1)
        if world_size is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    "ShardPlan.for_ranks needs world_size and rank, or an initialised torch.distributed process group "
                    "(launch with torchrun and call pikv_hf.distributed.init_process_group() first)"
                )
            world_size = dist.get_world_size(group) if world_size is None else world_size
            rank = dist.get_rank(group) if rank is None else rank
            if rank < 0 or world_size < 0:  # torch.distributed's answer on a process outside `group`
                raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")
        check_int_at_least("world_size", world_size, 1)
        if num_shards % world_size:
            raise ValueError(
                f"num_shards={num_shards} must be a multiple of world_size={world_size} (each rank owns "
                "num_shards / world_size shards); choose num_shards accordingly"
            )
        per = num_shards // world_size
        owner = tuple(s // per for s in range(num_shards))
        return cls(owner, (None,) * world_size, rank, world_size, timeout, group)

    @classmethod
    def for_devices(
        cls, num_shards: int, devices: Sequence[str | int | torch.device] | Mapping[int, str | int | torch.device]
    ) -> ShardPlan:
        """Partitions on devices of this process.

        ``devices`` is either a list (one partition per entry, a device may repeat; shard ``s`` goes to entry
        ``s * len(devices) // num_shards``, contiguous balanced blocks) or an explicit map ``{shard: device}``
        naming every shard once (one partition per distinct device). Every device must exist.
        """
        check_int_at_least("num_shards", num_shards, 1)
        if isinstance(devices, Mapping):
            missing = sorted(set(range(num_shards)) - set(devices))
            extra = sorted(set(devices) - set(range(num_shards)), key=str)
            if missing or extra:
                raise ValueError(
                    f"the placement map must name every shard 0 .. {num_shards - 1} exactly once; "
                    f"missing {missing}, not shards {extra}"
                )
            names = [str(check_device(devices[s])) for s in range(num_shards)]
            distinct = list(dict.fromkeys(names))
            return cls(tuple(distinct.index(n) for n in names), tuple(distinct))
        if isinstance(devices, (str, torch.device)):
            raise TypeError(f"devices must be a list of devices (or a shard -> device map), got {devices!r}")
        devices = list(devices)
        if not 1 <= len(devices) <= num_shards:
            raise ValueError(f"devices must list 1 to num_shards={num_shards} devices, got {len(devices)}")
        names = tuple(str(check_device(d)) for d in devices)
        return cls(tuple(s * len(names) // num_shards for s in range(num_shards)), names)

    @classmethod
    def from_accelerate(cls, num_shards: int, max_memory: Mapping[int | str, int | str] | None = None) -> ShardPlan:
        """Partitions over the devices accelerate sees, each given shards in proportion to its memory.

        ``max_memory`` is accelerate's ``{device: bytes or "10GiB"}`` (integer keys are accelerator indices;
        default ``accelerate.utils.get_max_memory()``, the memory free now). ``"disk"`` is ignored, and ``"cpu"``
        too when any accelerator is listed (its KV would be attended on the CPU).
        """
        from accelerate.utils import convert_file_size_to_int, get_max_memory

        memory = dict(get_max_memory() if max_memory is None else max_memory)
        acc = _accelerator_type()
        sizes = {
            (f"{acc}:{d}" if isinstance(d, int) else str(d)): convert_file_size_to_int(v)
            for d, v in memory.items()
            if d != "disk"
        }
        if any(size < 0 for size in sizes.values()) or not any(size > 0 for size in sizes.values()):
            raise ValueError(f"max_memory must give some device a positive size and none a negative one, got {memory}")
        if any(d != "cpu" for d in sizes):
            sizes.pop("cpu", None)
        if not sizes:
            raise ValueError(f"max_memory names no device to hold KV (got {memory})")
        return cls.for_devices(num_shards, split_shards(num_shards, sizes))
