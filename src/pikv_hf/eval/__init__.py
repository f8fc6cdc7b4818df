"""Evaluation harness: offline RULER-style suite, LongBench, kvpress presses and PiKVCache, ``pikv-hf eval``."""
