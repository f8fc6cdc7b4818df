"""Registry of the selection routers: ``SELECTORS`` by name and ``make_selector``."""

from __future__ import annotations

from pikv_hf.routing.adaptive import AdaptiveSelector
from pikv_hf.routing.base import Selector
from pikv_hf.routing.cache_aware import CacheAwareSelector
from pikv_hf.routing.eplb import EPLBSelector
from pikv_hf.routing.hierarchical import HierarchicalSelector
from pikv_hf.routing.topk import TopKSelector
from pikv_hf.routing.topk_balanced import BalancedTopKSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls
    for cls in (
        TopKSelector,
        BalancedTopKSelector,
        CacheAwareSelector,
        EPLBSelector,
        AdaptiveSelector,
        HierarchicalSelector,
    )
}


def make_selector(name: str, **kwargs: object) -> Selector:
    """Build the selector registered as ``name`` with constructor ``kwargs``.

    Raises
    ------
    ValueError
        If ``name`` is not in ``SELECTORS`` (the message lists the valid names).
    """
    if not isinstance(name, str) or name not in SELECTORS:
        raise ValueError(f"selector must be one of {', '.join(SELECTORS)}; got {name!r}")
    return SELECTORS[name](**kwargs)
