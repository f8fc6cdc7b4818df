import os

import torch

# Deterministic, non-oversubscribed CPU runs (REFERENCE.md section 1: tiny generates vary 300x on a loaded box).
torch.set_num_threads(int(os.environ.get("PIKV_TEST_THREADS", "1")))

# Without a GPU the Triton kernels run interpreted on CPU tensors. Interpret mode is fixed when a kernel is
# decorated, i.e. when pikv_hf.kernels is first imported, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
