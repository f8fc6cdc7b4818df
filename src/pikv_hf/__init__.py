"""pikv_hf: expert-sharded, paged KV cache for Mixture-of-Experts models in Hugging Face transformers."""

from pikv_hf.attention import register as _register

# Registered before anything imports kvpress, which wraps the attention functions registered at its import time.
_register()

from pikv_hf.cache import PagedKV, PiKVCache, PiKVLayer, attach  # noqa: E402

__all__ = ["PagedKV", "PiKVCache", "PiKVLayer", "attach"]
__version__ = "0.1.0"
