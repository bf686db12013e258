"""Write three sites' own data from Fashion-MNIST, each site in a different format (docs/federation.md).

Each site holds its clients' images in the form that site happens to keep them; FairFL's agents read all three
(`fairfl serve agent --data SPEC`, fairfl/data/site.py):

    OUT/a/client-<k>.npz          site A: one NumPy file per client, x_train, y_train, x_test, y_test
                                  (float32 in [0, 1], shape (N, 1, 28, 28); labels int64)
    OUT/b/records.parquet         site B: one Parquet table for all its clients: a `ward` column naming the client,
                                  `label`, and 784 float32 pixel columns p0..p783 (row-major 28x28, in [0, 1]);
                                  no split given (the agent draws a seeded test fraction)
    OUT/c/clinic-<k>/{train,test}/<class name>/<i>.png
                                  site C: one folder of 8-bit grayscale PNGs per client and class, the classes
                                  named (t-shirt, trouser, ...), not numbered

Every client gets its own label mix: class proportions drawn from a Dirichlet(alpha) distribution, seeded, so the
clients differ as real sites' clients do. Clients never share an image: train images are drawn without replacement
from Fashion-MNIST's training set, test images from its test set.

    python examples/sites/make_site_data.py --out sites --clients-per-site 4 --train 200 --test 50
"""

from __future__ import annotations

import argparse
import gzip
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from fairfl.data.datasets import DEBIAN_FASHION_MNIST_DIR, parse_idx

# Fashion-MNIST's classes in label order: site C names its folders with these, so its agent gives them in this order
# (`classes=`), which maps them onto the labels the other sites use.
CLASS_NAMES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SITES = ("a", "b", "c")


def read_split(source: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's raw uint8 images (N, 28, 28) and labels (N,) from its IDX files (gzipped or not)."""
    arrays = []
    for stem in FILES[split]:
        path = next((p for p in (source / f"{stem}.gz", source / stem) if p.is_file()), None)
        if path is None:
            sys.exit(f"error: {source} has no {stem}[.gz]; install dataset-fashion-mnist or give --source DIR")
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        arrays.append(parse_idx(data, str(path)))
    return arrays[0], arrays[1].astype(np.int64)


class Pools:
    """Per-class pools of one split's indices, drawn from without replacement."""

    def __init__(self, labels: np.ndarray, rng: np.random.Generator) -> None:
        self.pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(len(CLASS_NAMES))]

    def draw(self, counts: np.ndarray) -> np.ndarray:
        taken: list[int] = []
        for c, n in enumerate(counts):
            if n > len(self.pools[c]):
                sys.exit(f"error: not enough images of class {CLASS_NAMES[c]} left; ask for fewer clients or images")
            taken += self.pools[c][:n]
            del self.pools[c][:n]
        return np.array(taken, dtype=np.int64)


def to_float(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28) in [0, 1], the scale Pillow-decoded PNGs get at site C."""
    return (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]


@dataclass(frozen=True)
class Client:
    """One client's images: raw uint8 (N, 28, 28) and int64 labels, train and test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def write_npz(path: Path, c: Client) -> None:
    np.savez(path, x_train=to_float(c.x_train), y_train=c.y_train, x_test=to_float(c.x_test), y_test=c.y_test)


def write_parquet(path: Path, clients: dict[str, Client]) -> None:
    """One table: `ward` (the client), `label`, p0..p783. Train and test rows together: the agent splits them."""
    xs = [np.concatenate([c.x_train, c.x_test]) for c in clients.values()]
    x = to_float(np.concatenate(xs)).reshape(sum(map(len, xs)), -1)
    y = np.concatenate([np.concatenate([c.y_train, c.y_test]) for c in clients.values()])
    wards = [name for name, xc in zip(clients, xs, strict=True) for _ in range(len(xc))]
    columns = {"ward": pa.array(wards), "label": pa.array(y)}
    columns.update({f"p{i}": pa.array(x[:, i]) for i in range(x.shape[1])})
    pq.write_table(pa.table(columns), path)


def write_pngs(folder: Path, images: np.ndarray, labels: np.ndarray) -> None:
    for c in CLASS_NAMES:
        (folder / c).mkdir(parents=True, exist_ok=True)  # every class folder, empty ones too
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        Image.fromarray(image).save(folder / CLASS_NAMES[label] / f"{i:05d}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("sites"), help="where the site folders go (default sites)")
    parser.add_argument("--source", type=Path, default=DEBIAN_FASHION_MNIST_DIR, help="Fashion-MNIST's IDX files")
    parser.add_argument("--clients-per-site", type=int, default=4, help="clients at each site (default 4)")
    parser.add_argument("--train", type=int, default=200, help="training images per client (default 200)")
    parser.add_argument("--test", type=int, default=50, help="test images per client (default 50)")
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet alpha of the label mixes (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.clients_per_site < 1 or args.train < 1 or args.test < 1 or args.alpha <= 0:
        parser.error("--clients-per-site, --train, --test and --alpha must be positive")

    rng = np.random.default_rng(args.seed)
    (x_train, y_train), (x_test, y_test) = read_split(args.source, "train"), read_split(args.source, "test")
    train_pool, test_pool = Pools(y_train, rng), Pools(y_test, rng)

    def client() -> Client:
        mix = rng.dirichlet(np.full(len(CLASS_NAMES), args.alpha))  # this client's class proportions
        tr = train_pool.draw(rng.multinomial(args.train, mix))
        te = test_pool.draw(rng.multinomial(args.test, mix))
        return Client(x_train[tr], y_train[tr], x_test[te], y_test[te])

    n = args.clients_per_site
    site_a, site_b, site_c = (args.out / s for s in SITES)
    for site in (site_a, site_b, site_c):
        site.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        write_npz(site_a / f"client-{k}.npz", client())
    write_parquet(site_b / "records.parquet", {f"ward-{k + 1}": client() for k in range(n)})
    for k in range(n):
        c = client()
        write_pngs(site_c / f"clinic-{k + 1}" / "train", c.x_train, c.y_train)
        write_pngs(site_c / f"clinic-{k + 1}" / "test", c.x_test, c.y_test)

    per_site = n * (args.train + args.test)
    print(f"{site_a}: {n} .npz files (x_train, y_train, x_test, y_test), {per_site} images")
    print(f"{site_b}: records.parquet, {per_site} rows x (ward, label, p0..p783), clients by `ward`")
    print(f"{site_c}: {n} folders of PNGs, <client>/train|test/<class name>/, {per_site} images")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
