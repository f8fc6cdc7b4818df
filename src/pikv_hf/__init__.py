"""pikv_hf: expert-sharded, paged KV cache for Mixture-of-Experts models in Hugging Face transformers."""

from pikv_hf.hf import register as _register

# Registered before kvpress is imported: kvpress wraps the attention functions registered at its import time, and
# its head-wise presses (AdaKV, DuoAttention, ...) work only through that wrapper.
_register()

from pikv_hf.kvpress_compat import install as _install_kvpress_compat  # noqa: E402

_install_kvpress_compat()

from pikv_hf.cache import PiKVCache  # noqa: E402
from pikv_hf.export import register as _register_export  # noqa: E402

_register_export()
from pikv_hf.config import ReadConfig  # noqa: E402
from pikv_hf.forward import PagedKV  # noqa: E402
from pikv_hf.hf import attach  # noqa: E402
from pikv_hf.layer import PiKVLayer  # noqa: E402

__all__ = ["PagedKV", "PiKVCache", "PiKVLayer", "ReadConfig", "attach"]
__version__ = "0.1.0"
