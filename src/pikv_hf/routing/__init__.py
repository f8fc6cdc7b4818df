"""PiKV routers: placement (token -> shard) and selection (decode-time query -> top-k shards)."""

from __future__ import annotations

from pikv_hf.routing.base import Placement, PlacementContext, Selector, ShardSummary
from pikv_hf.routing.expert import ExpertPlacement, ExpertTap
from pikv_hf.routing.hash import RoundRobinPlacement
from pikv_hf.routing.key_cluster import KeyClusterPlacement
from pikv_hf.routing.selectors import SELECTORS, make_selector

PLACEMENTS = ("round_robin", "hash", "expert", "key_cluster")


def check_placement_name(name: str) -> str:
    """Canonical name of a placement router (``hash`` is an alias of ``round_robin``); ValueError if unknown."""
    if name not in PLACEMENTS:
        raise ValueError(f"router must be one of {', '.join(PLACEMENTS)}; got {name!r}")
    return "round_robin" if name == "hash" else name


def make_placement(name: str, num_shards: int, layer_idx: int, tap: ExpertTap | None = None) -> Placement:
    """Build the placement router of one layer. ``expert`` needs the ``ExpertTap`` installed on the model."""
    name = check_placement_name(name)
    if name == "round_robin":
        return RoundRobinPlacement(num_shards)
    if name == "key_cluster":
        return KeyClusterPlacement(num_shards)
    if tap is None:
        raise ValueError("router='expert' needs the model: build the cache with PiKVCache(model, router='expert')")
    return ExpertPlacement(num_shards, tap, layer_idx)


__all__ = [
    "PLACEMENTS",
    "ExpertPlacement",
    "ExpertTap",
    "KeyClusterPlacement",
    "Placement",
    "PlacementContext",
    "RoundRobinPlacement",
    "SELECTORS",
    "Selector",
    "ShardSummary",
    "check_placement_name",
    "make_placement",
    "make_selector",
]
