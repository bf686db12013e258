"""Write scikit-learn's digits (1,797 8x8 images, shipped with scikit-learn, no download) as the CSV files
CsvFolder reads: train.csv (1,500 rows) and test.csv (297), features scaled to [0, 1].

    .venv/bin/python examples/file_dataset/make_digits.py runs/examples/digits
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

TRAIN = 1500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    out = parser.parse_args().directory
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))  # a fixed shuffle: the same files every time
    table = np.column_stack([digits.target, digits.data / 16.0])[order]
    header = ",".join(["label", *(f"p{i}" for i in range(digits.data.shape[1]))])
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", table[:TRAIN]), ("test", table[TRAIN:])):
        fmt = ["%d"] + ["%.6g"] * digits.data.shape[1]
        np.savetxt(out / f"{split}.csv", rows, delimiter=",", header=header, comments="", fmt=fmt)
        print(f"wrote {out / f'{split}.csv'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
