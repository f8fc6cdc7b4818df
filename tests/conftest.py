import os

import torch

# Deterministic, non-oversubscribed CPU runs (REFERENCE.md section 1: tiny generates vary 300x on a loaded box).
torch.set_num_threads(int(os.environ.get("PIKV_TEST_THREADS", "1")))
