"""pikv_hf: expert-sharded, paged KV cache for Mixture-of-Experts models in Hugging Face transformers."""

from pikv_hf.hf import register as _register

# Registered before anything imports kvpress, which wraps the attention functions registered at its import time.
_register()

from pikv_hf.cache import PiKVCache  # noqa: E402
from pikv_hf.config import ReadConfig  # noqa: E402
from pikv_hf.hf import attach  # noqa: E402
from pikv_hf.layer import PagedKV, PiKVLayer  # noqa: E402

__all__ = ["PagedKV", "PiKVCache", "PiKVLayer", "ReadConfig", "attach"]
__version__ = "0.1.0"
