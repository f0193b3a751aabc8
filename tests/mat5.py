"""A writer of MATLAB level-5 .mat files for the tests (capsroute reads them,
capsroute.datasets.affnist; it writes none), and the affNIST struct in that form."""

import struct
import zlib
from pathlib import Path

import numpy as np

# MAT level 5: element types and array classes the writer below uses.
_TYPES = {np.dtype("u1"): (2, 9), np.dtype("f8"): (9, 6), np.dtype("i4"): (5, 12)}
_MI_INT8, _MI_INT32, _MI_UINT32, _MI_MATRIX, _MI_COMPRESSED = 1, 5, 6, 14, 15


def _element(kind: int, payload: bytes, order: str) -> bytes:
    """A tagged element, its payload padded to 8 bytes; 4 bytes or less in the small format."""
    if 0 < len(payload) <= 4:
        return struct.pack(order + "I", len(payload) << 16 | kind) + payload.ljust(4, b"\0")
    return struct.pack(order + "II", kind, len(payload)) + payload + b"\0" * (-len(payload) % 8)


def _matrix(name: str, value, order: str) -> bytes:
    """An miMATRIX element of a numeric array (column-major, as MATLAB stores it) or a 1x1
    struct of them (a dict)."""
    if isinstance(value, dict):
        cls, dims = 2, (1, 1)
    else:
        value = np.asarray(value)
        kind, cls = _TYPES[value.dtype]
        dims = value.shape if value.ndim >= 2 else (1, value.size)
    parts = [
        _element(_MI_UINT32, struct.pack(order + "II", cls, 0), order),
        _element(_MI_INT32, struct.pack(order + f"{len(dims)}i", *dims), order),
        _element(_MI_INT8, name.encode(), order),
    ]
    if isinstance(value, dict):
        length = 32
        names = b"".join(f.encode().ljust(length, b"\0") for f in value)
        parts.append(_element(_MI_INT32, struct.pack(order + "i", length), order))
        parts.append(_element(_MI_INT8, names, order))
        parts += [_matrix("", v, order) for v in value.values()]
    else:
        data = value.reshape(dims).ravel(order="F").astype(value.dtype.newbyteorder(order))
        parts.append(_element(kind, data.tobytes(), order))
    return _element(_MI_MATRIX, b"".join(parts), order)


def write_mat(path: Path, variables: dict, compress: bool = True, order: str = "<") -> Path:
    """A level-5 MAT file of these variables, each element zlib-compressed (MATLAB's default since
    version 7) or not, in either byte order."""
    header = b"MATLAB 5.0 MAT-file, written by capsroute's tests".ljust(116) + b"\0" * 8
    header += struct.pack(order + "H", 0x0100) + (b"IM" if order == "<" else b"MI")
    body = b""
    for name, value in variables.items():
        element = _matrix(name, value, order)
        if compress:
            packed = zlib.compress(element)
            element = struct.pack(order + "II", _MI_COMPRESSED, len(packed)) + packed
        body += element
    path.write_bytes(header + body)
    return path


def affnist_struct(count: int, seed: int = 0) -> dict:
    """affNISTdata as the published files hold it: one 40x40 image per column, pixels row by row."""
    g = np.random.default_rng(seed)
    images = g.integers(0, 256, (count, 40, 40), dtype=np.uint8)
    return {
        "affine_transform": g.normal(size=(6, count)),
        "human_readable_transform": g.normal(size=(7, count)),
        "image": np.ascontiguousarray(images.reshape(count, 1600).T),
        "label_int": (np.arange(count) % 10).astype(np.uint8)[None],
        "label_one_of_n": np.eye(10)[np.arange(count) % 10].T.copy(),
    }, images
