"""Read policies (exact, routed, Quest), the read plans they produce and the statistics of sparse reads.

Importing this package registers the sparse policies (``routed.py``, ``quest.py``) with ``policy.make_policy``.
"""

from pikv_hf.read.plan import ReadPlan, compact, sink_or_recent
from pikv_hf.read.policy import ExactRead, make_policy
from pikv_hf.read.quest import QuestRead
from pikv_hf.read.routed import RoutedRead
from pikv_hf.read.stats import ReadStats

__all__ = ["ExactRead", "QuestRead", "ReadPlan", "ReadStats", "RoutedRead", "compact", "make_policy", "sink_or_recent"]
