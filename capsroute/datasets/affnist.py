"""affnist: the published affNIST files (https://www.cs.toronto.edu/~tijmen/affNIST/, Tieleman
2013), read where a user has them. capsroute does not ship or download them; the generated
stand-in is capsroute.datasets.affine_mnist ("affine-mnist").

  read_mat(path)                 a MATLAB level-5 .mat file -> {name: value} (the arrays affNIST uses)
  find_test_files(root)          the transformed test set's file(s) under root
  load_test(root)                -> AffNIST: images uint8 (N, 1, 40, 40), labels, transforms
  verify(data)                   the structure check that stands in for checksums (below)

The test set, each of the 10,000 MNIST test digits under 32 random affine transformations, is
published as `32x/transformed/test.mat.zip` (one file, test.mat, 320,000 images) and as
`32x/transformed/test_batches.zip` (1.mat .. 32.mat, 10,000 each). Each file holds one struct,
affNISTdata, whose fields the loader reads: image (1600 x N uint8, a 40x40 image per column, its
pixels row by row, as the public loaders read them), label_int (1 x N, 0..9) and, where present,
human_readable_transform and affine_transform (kept as given, one column per image). No
published checksums were found for these files, so `verify` checks what is known of their
content instead: the shapes and types, labels in 0..9, and for the whole test set (320,000
images) the label counts, 32 times those of the MNIST test split.

The reader takes what MATLAB's `save` writes at level 5 (MATLAB 5 to 7.2, the default): zlib
compressed elements, numeric arrays, structs, cells and char arrays, either byte order. It does
not read sparse arrays, objects or MAT 7.3 files (HDF5), and says so.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

SIZE = 40
TEST_IMAGES = 320_000
TEST_BATCHES = 32
# MNIST test split's label counts (digits 0..9); affNIST's test set holds each digit 32 times.
MNIST_TEST_COUNTS = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)
FILES = ("test.mat",)  # or test_batches/1.mat .. 32.mat

_HEADER = 128
# Element types: numpy dtypes by type code, and the two that hold other elements.
_MI_TYPES = {
    1: "i1",
    2: "u1",
    3: "i2",
    4: "u2",
    5: "i4",
    6: "u4",
    7: "f4",
    9: "f8",
    12: "i8",
    13: "u8",
}
_MI_MATRIX, _MI_COMPRESSED, _MI_UTF8 = 14, 15, 16
# Array classes: numeric ones by class code, and the others this reader takes.
_CLASSES = {
    6: "f8",
    7: "f4",
    8: "i1",
    9: "u1",
    10: "i2",
    11: "u2",
    12: "i4",
    13: "u4",
    14: "i8",
    15: "u8",
}
_CELL, _STRUCT, _CHAR = 1, 2, 4


class MatError(ValueError):
    """A file that is not a level-5 MAT file this reader takes."""


class _Reader:
    """Data elements from a buffer in the file's byte order."""

    def __init__(self, data: bytes, order: str, path: Path):
        self.data, self.order, self.path, self.pos = data, order, path, 0

    def fail(self, what: str):
        raise MatError(f"{self.path}: {what} (at byte {self.pos} of an element stream)")

    def element(self) -> tuple[int, bytes]:
        """(type, payload) of the next element; the position moves past its padding."""
        if self.pos + 8 > len(self.data):
            self.fail("truncated element tag")
        first, second = np.frombuffer(self.data, self.order + "u4", 2, self.pos)
        if first >> 16:  # the small element format: size and type in 4 bytes, data in the next 4
            kind, size, start, end = int(first & 0xFFFF), int(first >> 16), self.pos + 4, 8
            if size > 4:
                self.fail(f"small element of {size} bytes (at most 4)")
        else:
            kind, size, start = int(first), int(second), self.pos + 8
            end = 8 + size + (0 if kind == _MI_COMPRESSED else -size % 8)
        if start + size > len(self.data):
            self.fail(f"truncated element: {size} bytes announced")
        payload = self.data[start : start + size]
        self.pos += end
        return kind, payload

    def numbers(self, kind_payload=None) -> np.ndarray:
        kind, payload = kind_payload or self.element()
        if kind not in _MI_TYPES:
            self.fail(f"element type {kind} where numbers were expected")
        return np.frombuffer(payload, self.order + _MI_TYPES[kind])

    def matrix(self):
        """(name, value) of the next element, an array nested in a cell or struct."""
        kind, payload = self.element()
        if kind != _MI_MATRIX:
            self.fail(f"element type {kind} where an array was expected")
        return _matrix(_Reader(payload, self.order, self.path))

    def done(self) -> bool:
        return self.pos >= len(self.data)


def _value(kind: int, payload: bytes, order: str, path: Path):
    """The value of one top-level or nested element: (name, value)."""
    if kind == _MI_COMPRESSED:
        try:
            payload = zlib.decompress(payload)
        except zlib.error as e:
            raise MatError(f"{path}: corrupt compressed element ({e})") from e
        inner = _Reader(payload, order, path)
        return _value(*inner.element(), order, path)
    if kind != _MI_MATRIX:
        raise MatError(f"{path}: top-level element of type {kind}, not an array")
    return _matrix(_Reader(payload, order, path))


def _matrix(r: _Reader):
    """(name, value) of an miMATRIX element's content."""
    if r.done():  # an empty array is written as an empty element
        return "", np.zeros((0, 0))
    flags = r.numbers()
    cls = int(flags[0] & 0xFF)
    dims = tuple(int(d) for d in r.numbers())
    name = r.numbers().tobytes().decode("ascii", "replace")
    count = int(np.prod(dims))
    if cls in _CLASSES or cls == _CHAR:
        kind, payload = r.element()
        if cls == _CHAR and kind == _MI_UTF8:
            return name, payload.decode("utf-8")
        values = r.numbers((kind, payload))
        if len(values) != count:
            r.fail(f"{name or 'array'}: {len(values)} values for dimensions {dims}")
        if flags[0] & 0x800:
            r.fail(f"{name or 'array'}: complex arrays are not read here")
        if cls == _CHAR:
            return name, "".join(map(chr, values))
        return name, values.astype(_CLASSES[cls]).reshape(dims, order="F")
    if cls == _CELL:
        return name, [r.matrix()[1] for _ in range(count)]
    if cls == _STRUCT:
        length = int(r.numbers()[0])
        raw = r.numbers().tobytes()
        fields = [
            raw[i : i + length].split(b"\0")[0].decode("ascii") for i in range(0, len(raw), length)
        ]
        elements = [{f: r.matrix()[1] for f in fields} for _ in range(count)]
        return name, elements[0] if count == 1 else elements
    r.fail(f"{name or 'array'}: array class {cls} (sparse, object or function) is not read here")


def read_mat(path: str | os.PathLike) -> dict:
    """The variables of a level-5 MAT file: numeric arrays as numpy arrays of MATLAB's shape and
    class, 1x1 structs as {field: value} (others as lists of them), cells as lists, char arrays
    as str.

    Raises MatError, naming the file, for anything else: another format (MAT 4, MAT 7.3's HDF5),
    a truncated or corrupt file, or arrays of a kind this reader does not take.
    """
    path = Path(path)
    data = path.read_bytes()
    if data[:8] == b"\x89HDF\r\n\x1a\n" or data[512:520] == b"\x89HDF\r\n\x1a\n":
        raise MatError(f"{path}: a MAT 7.3 (HDF5) file; save it with -v7 to read it here")
    if len(data) < _HEADER or data[126:128] not in (b"IM", b"MI"):
        raise MatError(f"{path}: not a level-5 MAT file (no MATLAB 5.0 header)")
    order = "<" if data[126:128] == b"IM" else ">"
    stream = _Reader(data[_HEADER:], order, path)
    variables = {}
    while not stream.done():
        name, value = _value(*stream.element(), order, path)
        variables[name] = value
    return variables


class AffNIST(NamedTuple):
    images: Tensor  # (N, 1, 40, 40) uint8
    labels: Tensor  # (N,) int64
    transforms: dict[str, np.ndarray]  # human_readable_transform, affine_transform: (k, N) each
    files: list[Path]


def find_test_files(root: str | os.PathLike) -> list[Path]:
    """The transformed test set under root: root/test.mat, or root/1.mat .. 32.mat (test_batches,
    also in root/test_batches/). Raises FileNotFoundError, in one line, naming where it looked."""
    root = Path(root)
    if (root / "test.mat").is_file():
        return [root / "test.mat"]
    for folder in (root, root / "test_batches"):
        batches = [folder / f"{k}.mat" for k in range(1, TEST_BATCHES + 1)]
        if all(p.is_file() for p in batches):
            return batches
    raise FileNotFoundError(
        f"no affNIST test files in {root}: expected test.mat (32x/transformed/test.mat.zip, "
        f"unzipped) or 1.mat .. {TEST_BATCHES}.mat (test_batches.zip) there or in "
        f"{root / 'test_batches'}; capsroute does not download affNIST"
    )


def _read_struct(path: Path) -> dict:
    variables = read_mat(path)
    data = variables.get("affNISTdata")
    if not isinstance(data, dict) or "image" not in data or "label_int" not in data:
        raise MatError(
            f"{path}: not an affNIST file (no affNISTdata struct with image and label_int; "
            f"it holds {', '.join(variables) or 'nothing'})"
        )
    return data


def load_test(root: str | os.PathLike, limit: int | None = None) -> AffNIST:
    """The affNIST test set under root (find_test_files), checked by `verify`; `limit`: only the
    first images (the first files that hold them). Raises FileNotFoundError or MatError."""
    files = find_test_files(root)
    images, labels, transforms = [], [], {}
    seen = 0
    for path in files:
        data = _read_struct(path)
        image, label = data["image"], np.asarray(data["label_int"]).reshape(-1)
        if image.dtype != np.uint8 or image.ndim != 2 or image.shape[0] != SIZE * SIZE:
            raise MatError(
                f"{path}: affNISTdata.image must be 1600 x N uint8, got {image.dtype} {image.shape}"
            )
        if len(label) != image.shape[1]:
            raise MatError(f"{path}: {image.shape[1]} images but {len(label)} labels")
        images.append(image.T.reshape(-1, 1, SIZE, SIZE))
        labels.append(label)
        for key in ("human_readable_transform", "affine_transform"):
            if key in data:
                transforms.setdefault(key, []).append(np.asarray(data[key], dtype=np.float64))
        seen += len(label)
        if limit is not None and seen >= limit:
            break
    result = AffNIST(
        torch.from_numpy(np.concatenate(images)[:limit]),
        torch.from_numpy(np.concatenate(labels)[:limit].astype(np.int64)),
        {k: np.concatenate(v, 1)[:, :limit] for k, v in transforms.items()},
        files,
    )
    verify(result)
    return result


def verify(data: AffNIST) -> None:
    """What stands in for checksums: labels in 0..9, and the whole test set's label counts 32
    times MNIST's test split's. Raises MatError naming the files."""
    where = data.files[0].parent
    labels = data.labels
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise MatError(
            f"{where}: affNIST labels must be 0..9, found {labels.min()}..{labels.max()}"
        )
    if len(labels) == TEST_IMAGES:
        counts = torch.bincount(labels, minlength=10).tolist()
        expected = [TEST_BATCHES * c for c in MNIST_TEST_COUNTS]
        if counts != expected:
            raise MatError(
                f"{where}: {TEST_IMAGES} images whose label counts {counts} are not affNIST's "
                f"test set's (32 x MNIST's test counts, {expected})"
            )


__all__ = [
    "AffNIST",
    "MNIST_TEST_COUNTS",
    "MatError",
    "SIZE",
    "TEST_IMAGES",
    "find_test_files",
    "load_test",
    "read_mat",
    "verify",
]
