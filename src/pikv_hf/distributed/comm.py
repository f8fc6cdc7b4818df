"""Collectives of a partitioned cache over ``torch.distributed``, each with a timeout and a clear error.

Two collectives are used: at setup an all-gather of a small fingerprint of the cache settings and the model config
(``check_same``: every rank must build the same cache), and at every attention call an all-gather of this rank's
partial attention ``(o, lse)`` (``gather_partials``). Both are issued asynchronously and waited on with the
configured timeout; a timeout or a dead peer (gloo reports a closed connection at once) becomes a
:class:`CollectiveError` naming the collective, this rank and the timeout, instead of a hang.

On NCCL, ``Work.wait`` only makes the current stream wait; set ``TORCH_NCCL_BLOCKING_WAIT=1`` so a timeout raises
in the calling thread (otherwise NCCL's watchdog aborts the process after the process group's timeout).
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pikv_hf.distributed.plan import DEFAULT_TIMEOUT_S

FIELD_BYTES = 64  # fingerprint values longer than this are compared by hash


class CollectiveError(RuntimeError):
    """A collective of a partitioned cache failed or timed out (a peer rank died, is stuck or diverged)."""


def init_process_group(timeout: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Initialise ``torch.distributed`` from the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` picks the GPU), with ``timeout`` seconds per collective.

    ``backend`` defaults to NCCL when CUDA is available (each rank then uses ``cuda:LOCAL_RANK``), else gloo.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variables {', '.join(missing)} are not set: launch with torchrun "
            "(torchrun --nproc-per-node N script.py) or set them for every process"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


def _encode(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > FIELD_BYTES:
        raw = ("sha256:" + hashlib.sha256(raw).hexdigest()[:32]).encode()
    return raw.ljust(FIELD_BYTES, b"\0")


class Communicator:
    """The process group of a partitioned cache, its timeout and the bytes handed to its collectives.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the cache's shards (default: the world).
    timeout : float
        Seconds a collective may take before :class:`CollectiveError`.

    Attributes
    ----------
    calls, payload_bytes : int
        Collectives of attention partials issued and the bytes of the tensors this rank handed to them (each
        reaches the ``world_size - 1`` other ranks: ``sent_bytes``).
    """

    def __init__(self, group: object = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a plan over ranks needs an initialised torch.distributed process group: launch with torchrun and "
                "call pikv_hf.distributed.init_process_group() before building the cache"
            )
        self.group, self.timeout = group, float(timeout)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.calls = 0
        self.payload_bytes = 0

    @property
    def sent_bytes(self) -> int:
        return self.payload_bytes * (self.world_size - 1)

    def _all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        t = tensor.to(self.device).contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        start = time.monotonic()
        try:
            work = dist.all_gather(out, t, group=self.group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise CollectiveError(
                f"pikv_hf.distributed: all_gather of {what} failed on rank {self.rank} of {self.world_size} after "
                f"{time.monotonic() - start:.1f} s (collective timeout {self.timeout:g} s): another rank died, is "
                f"stuck or stopped calling the cache. Cause: {err}"
            ) from err
        return out

    def gather_partials(self, o: torch.Tensor, lse: torch.Tensor, what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's ``(o [B, Hq, q, Dv], lse [B, Hq, q])`` float32 partial, in rank order, on ``o``'s device."""
        packed = torch.cat([o, lse.unsqueeze(-1)], dim=-1)
        gathered = self._all_gather(packed, what)
        self.calls += 1
        self.payload_bytes += packed.numel() * packed.element_size()
        return [(g[..., :-1].to(o.device), g[..., -1].to(o.device)) for g in gathered]

    def check_same(self, fields: dict[str, object]) -> None:
        """Raise ``ValueError`` naming every field whose value differs across ranks (and the ranks' values).

        Every rank must call this with the same field names, in the same order.
        """
        names = list(fields)
        packed = torch.tensor([list(_encode(str(fields[n]))) for n in names], dtype=torch.uint8)
        gathered = [g.cpu() for g in self._all_gather(packed, "the cache settings (setup check)")]
        problems = []
        for i, name in enumerate(names):
            try:
                values = [bytes(g[i].tolist()).rstrip(b"\0").decode() for g in gathered]
            except UnicodeDecodeError:  # another rank's all-gather was not this one: the ranks made different calls
                raise CollectiveError(
                    f"pikv_hf.distributed: rank {self.rank} of {self.world_size} checked the cache settings while "
                    "another rank ran a different collective: every rank must make the same calls (build the cache, "
                    "set_attention, forwards) in the same order"
                ) from None
            if len(set(values)) > 1:
                by_value: dict[str, list[int]] = {}
                for r, v in enumerate(values):
                    by_value.setdefault(v, []).append(r)
                problems.append(f"{name}: " + "; ".join(f"{v!r} on ranks {rs}" for v, rs in by_value.items()))
        if problems:
            raise ValueError(
                f"PiKVCache settings differ across ranks (rank {self.rank} of {self.world_size}): "
                + " | ".join(problems)
                + ". Every rank must build the cache with the same arguments and the same model config."
            )
