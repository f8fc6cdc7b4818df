import os

import pytest
import torch

# Deterministic, non-oversubscribed CPU runs (REFERENCE.md section 1: tiny generates vary 300x on a loaded box).
torch.set_num_threads(int(os.environ.get("PIKV_TEST_THREADS", "1")))

# Without a GPU the Triton kernels run interpreted on CPU tensors. Interpret mode is fixed when a kernel is
# decorated, i.e. when pikv_hf.kernels is first imported, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pikv_hf.config  # noqa: E402  (after TRITON_INTERPRET: the package imports its kernels)

SHIPPED_SPARSE_FROM = dict(pikv_hf.config.SPARSE_FROM)  # before any fixture replaces it


@pytest.fixture(autouse=True)
def sparse_reads_at_every_length(monkeypatch):
    """The tests decode a few dozen tokens: their routed and Quest caches read sparsely from the first step (a user's
    default is the measured threshold of ``pikv_hf.config.SPARSE_FROM``; tests/test_routed.py checks it)."""
    monkeypatch.setattr(pikv_hf.config, "SPARSE_FROM", dict.fromkeys(pikv_hf.config.SPARSE_FROM, 0))


@pytest.fixture
def shipped_sparse_from(monkeypatch):
    """The thresholds ``pikv_hf.config`` ships, back in place for one test (over the autouse zeros above)."""
    monkeypatch.setattr(pikv_hf.config, "SPARSE_FROM", SHIPPED_SPARSE_FROM)
