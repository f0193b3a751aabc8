"""Writes the small MNIST subset the training tests use (tests/data/mnist-small): the first
TRAIN training and TEST test images of the original IDX files, as IDX .gz files again.

  python scripts/make_mnist_subset.py data/mnist tests/data/mnist-small
"""

import gzip
import struct
import sys
from pathlib import Path

import numpy as np

from capsroute.datasets.mnist import DATASETS, read_idx

TRAIN, TEST = 3000, 1000


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX of uint8 data: magic 0x0000 08 <ndim>, big-endian uint32 dims, then the bytes.
    mtime=0 so that the same subset gives the same bytes."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main(source: str, target: str) -> None:
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in DATASETS["mnist"].filenames():
        count = TRAIN if name.startswith("train") else TEST
        write_idx(target / name, read_idx(Path(source) / name)[:count])
        print(f"wrote {target / name} ({count} samples)")


if __name__ == "__main__":
    main(*sys.argv[1:])
