"""Read policies (exact, routed, Quest), the read plans they produce and the statistics of sparse reads."""

from pikv_hf.read.plan import ReadPlan, sink_or_recent
from pikv_hf.read.policy import ExactRead, make_policy
from pikv_hf.read.quest import QuestRead
from pikv_hf.read.routed import RoutedRead
from pikv_hf.read.stats import RoutingStats

__all__ = ["ExactRead", "QuestRead", "ReadPlan", "RoutedRead", "RoutingStats", "make_policy", "sink_or_recent"]
