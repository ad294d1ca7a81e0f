import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py

import torch  # noqa: E402

# Tests check behaviour, not speed: one thread avoids oversubscribing small CPU machines
# (a tiny UNet forward takes ~15x longer with 2 threads when other processes compete).
torch.set_num_threads(1)
