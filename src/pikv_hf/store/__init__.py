"""Paged storage of one layer: the page pool, the per-(row, head) page table, shard statistics, and the store that
composes them."""

from pikv_hf.store.paged import STAT_FIELDS, PagedStore
from pikv_hf.store.pool import FieldSpec, PagePool
from pikv_hf.store.summary import ShardStats
from pikv_hf.store.table import PageTable

__all__ = ["STAT_FIELDS", "FieldSpec", "PagePool", "PageTable", "PagedStore", "ShardStats"]
