"""Suite-wide settings."""

import os

import torch

# Small models train fastest on one thread, and tests run beside service processes on few cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
