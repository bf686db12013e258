"""The CNN's 2x2 max-pooling without autograd on a CPU: PyTorch's kernel in the default (NCHW) layout against the
channels-last one fairfl.models.MaxPool2x2 uses, on FedAvgCNN's two pooling inputs for a batch of 300 Fashion-MNIST
images (one torch thread, best of 5).

    python scripts/bench_pool.py
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from fairfl.models import MaxPool2x2


def main() -> int:
    torch.set_num_threads(1)
    pool = MaxPool2x2()
    for shape in ((300, 32, 24, 24), (300, 64, 8, 8)):
        x = torch.relu(torch.randn(*shape))
        with torch.no_grad():
            assert torch.equal(pool(x), F.max_pool2d(x, 2))
            default = min(timeit.repeat(lambda x=x: F.max_pool2d(x, 2), number=10, repeat=5)) / 10
            channels_last = min(timeit.repeat(lambda x=x: pool(x), number=10, repeat=5)) / 10
        print(
            f"max-pool 2x2 of {list(shape)}: default layout {default * 1e3:.2f} ms, MaxPool2x2 (channels-last, "
            f"converted back) {channels_last * 1e3:.2f} ms, {default / channels_last:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
