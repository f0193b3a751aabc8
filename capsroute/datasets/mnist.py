"""MNIST and Fashion-MNIST in their original IDX form: reading, locating, downloading.

  read_idx(path)                           any IDX file (gzipped or not) -> numpy array
  DATASETS                                 file names, checksums and download mirrors of each dataset
  find_dataset_files(name, root)           the four IDX files under root, in any of the usual layouts
  download(name, root)                     fetch them into root/<name>/, checksum-verified, atomically
  verify_files(name, files)                check found files against the published checksums
  published_as(files)                      the dataset whose published files these are, if any
  load_dataset(name, root, split)          -> images uint8 (N, 1, 28, 28), labels int64 (N,)
  load_checked(name, root)                 both splits, refused when the files are another dataset's

The data are never fetched implicitly: `load_dataset` downloads only with download=True, and
otherwise names the places it looked and how to point it at a copy of the files.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "test")

# IDX element type codes (the third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file (gzip-compressed or not) into a native-byte-order numpy array.

    IDX layout: two zero bytes, a type code (see `_IDX_DTYPES`), the number of dimensions,
    one big-endian uint32 per dimension, then the elements, big-endian, in row-major order.
    Compression is recognised by the gzip magic bytes, not by the file name.

    Raises ValueError, naming the file, for a bad magic number, an unknown type code, a
    truncated header or payload, trailing bytes, or a corrupt gzip stream.
    """
    path = Path(path)
    with open(path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
    try:
        with gzip.open(path, "rb") if compressed else open(path, "rb") as f:
            data = f.read()
    except (EOFError, OSError, zlib.error) as e:
        if not compressed:
            raise
        raise ValueError(f"{path}: corrupt or truncated gzip stream ({e})") from e

    if len(data) < 4:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes, need at least 4)")
    zero0, zero1, type_code, ndim = data[:4]
    if zero0 != 0 or zero1 != 0:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()} (must start with two zero bytes)"
        )
    if type_code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise ValueError(f"{path}: unknown IDX type code 0x{type_code:02X} (known: {known})")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(
            f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dimensions need {header})"
        )
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = math.prod(shape) * dtype.itemsize
    found = len(data) - header
    if found < expected:
        raise ValueError(
            f"{path}: truncated IDX payload: shape {shape} of {dtype.name} needs "
            f"{expected} bytes of data, the file has {found}"
        )
    if found > expected:
        raise ValueError(
            f"{path}: {found - expected} unexpected trailing bytes after the IDX payload "
            f"(shape {shape} of {dtype.name} needs {expected} bytes)"
        )
    array = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=header)
    return array.reshape(shape).astype(dtype.newbyteorder("="))


@dataclass(frozen=True)
class DatasetInfo:
    """Where a dataset's four IDX files come from and what they must hash to.

    files:      split -> (images file, labels file), the gzipped names.
    sha256:     gzipped file name -> SHA256 (the download check).
    md5:        gzipped file name -> MD5 (as the original publishers list them).
    raw_md5:    uncompressed file name -> MD5 (for copies kept uncompressed, as torchvision does).
    mirrors:    base URLs, tried in order; a file's URL is mirror + file name.
    torchvision_dir: the folder torchvision uses, as in root/<torchvision_dir>/raw/.
    zero_fraction: the fraction of the published training images' pixels that are 0, which tells
                the datasets apart by content where the files are not the published ones (a subset).
    """

    files: dict[str, tuple[str, str]]
    sha256: dict[str, str]
    md5: dict[str, str]
    raw_md5: dict[str, str]
    mirrors: tuple[str, ...]
    torchvision_dir: str
    zero_fraction: float | None = None

    def filenames(self) -> list[str]:
        """The four gzipped file names, train images and labels first."""
        return [f for split in SPLITS for f in self.files[split]]


_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# Checksums of the original files: SHA256 and MD5, and the MD5 of each uncompressed file (as torchvision).
DATASETS: dict[str, DatasetInfo] = {
    "mnist": DatasetInfo(
        files=_MNIST_FILES,
        sha256={
            "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        },
        md5={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        raw_md5={
            "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
            "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
            "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
            "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
        },
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ),
        torchvision_dir="MNIST",
        zero_fraction=0.809,
    ),
    "fashion-mnist": DatasetInfo(
        files=_MNIST_FILES,
        sha256={
            "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        },
        md5={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        raw_md5={
            "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
            "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
            "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
        },
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        torchvision_dir="FashionMNIST",
        zero_fraction=0.502,
    ),
}


def _info(name: str) -> DatasetInfo:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})") from None


def _candidate_dirs(name: str, root: Path) -> list[Path]:
    # Most specific first: root/mnist and root/fashion-mnist hold files with the same names, so a
    # root that has both folders must not answer for one dataset with files meant for the other.
    return [root / name, root / _info(name).torchvision_dir / "raw", root]


def _find_in(directory: Path, gz_name: str) -> Path | None:
    """directory/<gz_name>, else its uncompressed twin, else None."""
    for candidate in (directory / gz_name, directory / gz_name.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def find_dataset_files(
    name: str, root: str | os.PathLike, download: bool = False
) -> dict[str, tuple[Path, Path]]:
    """Locates a dataset's four IDX files under root: split -> (images path, labels path).

    Looks, in this order, in root/<name>/, torchvision's root/<MNIST or FashionMNIST>/raw/ and
    root/ itself, and takes the first folder that holds all four files, each either gzipped
    (preferred) or uncompressed. When none does: with download=True downloads them into
    root/<name>/, else raises FileNotFoundError saying, in one line, where it looked and how to
    get the data.
    """
    info = _info(name)
    root = Path(root)
    looked = []
    for directory in _candidate_dirs(name, root):
        found = {f: _find_in(directory, f) for f in info.filenames()}
        if all(found.values()):
            return {
                split: (found[images], found[labels])
                for split, (images, labels) in info.files.items()
            }
        if directory.is_dir():
            missing = ", ".join(f for f, p in found.items() if p is None)
            looked.append(f"{directory}: missing {missing}")
        else:
            looked.append(f"{directory}: no such folder")
    if download:
        _download(name, root)
        return find_dataset_files(name, root)
    raise FileNotFoundError(
        f"could not find the {name} IDX files ({', '.join(info.filenames())}; gzipped or not); "
        f"looked in {'; '.join(looked)}. Pass --data-dir FOLDER with the four files, "
        f"or --download to fetch them (checksum-verified) into {root / name}"
    )


class ChecksumError(ValueError):
    """A file's content does not hash to its published checksum."""


def _digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_files(name: str, files: dict[str, tuple[Path, Path]]) -> None:
    """Checks files found by `find_dataset_files` against the dataset's published checksums.

    Gzipped files are checked by SHA256, uncompressed ones by the MD5 of the uncompressed
    original. Raises ChecksumError naming the file and both digests.
    """
    info = _info(name)
    for images, labels in files.values():
        for path in (images, labels):
            if path.name in info.sha256:
                algorithm, expected = "sha256", info.sha256[path.name]
            else:
                algorithm, expected = "md5", info.raw_md5[path.name]
            actual = _digest(path, algorithm)
            if actual != expected:
                raise ChecksumError(
                    f"{path}: {algorithm.upper()} mismatch: expected {expected}, got {actual} "
                    f"(not the {name} file of that name, or a damaged copy)"
                )


def published_as(files: dict[str, tuple[Path, Path]]) -> str | None:
    """The registered dataset whose published checksums all these files match, or None (a
    subset, another copy or other data)."""
    for name in DATASETS:
        try:
            verify_files(name, files)
        except ChecksumError:
            continue
        return name
    return None


class WrongDatasetError(ValueError):
    """The files asked for as one dataset are another's."""


def looks_like(images: torch.Tensor) -> str | None:
    """The registered dataset whose images these look like (uint8): the one whose share of 0
    pixels is nearest theirs (MNIST's digits leave 81% of the pixels 0, Fashion-MNIST's clothes 50%)."""
    known = {
        name: info.zero_fraction
        for name, info in DATASETS.items()
        if info.zero_fraction is not None
    }
    zeros = (images == 0).float().mean().item() if len(images) else None
    return (
        None
        if zeros is None
        else min(known, key=lambda name: abs(known[name] - zeros), default=None)
    )


def load_checked(name: str, root: str | os.PathLike, download: bool = False):
    """Both splits of a dataset, {split: (images, labels)} as `load_dataset` gives them, and a
    warning (None when the files are the published ones).

    The files are verified against the dataset's published checksums (`verify_files`). Raises
    WrongDatasetError when they are another dataset's published files, or when they are not
    published files and look like another dataset's (`looks_like`), and ValueError (naming the
    file) when one is corrupt or truncated.
    """
    files = find_dataset_files(name, root, download)
    folder = files["train"][0].parent
    published = published_as(files)
    if published not in (name, None):
        raise WrongDatasetError(
            f"the files in {folder} are the published {published} files, not "
            f"{name}'s: pass --dataset {published}, or a --data-dir with {name}'s"
        )
    splits = {split: load_dataset(name, root, split) for split in SPLITS}
    if published == name:
        return splits, None
    resembled = looks_like(splits["train"][0])
    if resembled not in (name, None):
        raise WrongDatasetError(
            f"the images in {folder} look like {resembled}'s, not {name}'s: pass "
            f"--dataset {resembled}, or a --data-dir with {name}'s"
        )
    return splits, (
        f"{folder} does not hold the published {name} files (a subset, or another copy): "
        f"their checksums are not checked"
    )


# The URL opener `download` uses; tests replace it to serve bytes without a network.
_urlopen = urllib.request.urlopen
_TIMEOUT_S = 60
_CHUNK = 1 << 16


def _progress_bar(total: int | None, desc: str):
    """A tqdm bar counting bytes, or None where tqdm (an optional dependency) is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc)


def _fetch(url: str, target: Path, sha256: str, progress: bool) -> None:
    """Streams url into a temporary file beside target and renames it to target once its SHA256
    matches; on any failure the temporary file is removed and the error propagates."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _urlopen(url, timeout=_TIMEOUT_S) as response:
            size = response.headers.get("Content-Length")
            bar = _progress_bar(int(size) if size else None, target.name) if progress else None
            try:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    h.update(chunk)
                    out.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            finally:
                if bar is not None:
                    bar.close()
        if h.hexdigest() != sha256:
            raise ChecksumError(f"SHA256 mismatch: expected {sha256}, got {h.hexdigest()}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def download(name: str, root: str | os.PathLike, progress: bool = True) -> Path:
    """Downloads a dataset's four IDX .gz files into root/<name>/ and returns that folder.

    Each file is fetched from the dataset's mirrors in order into a temporary file and renamed
    into place only after its SHA256 matches, so an interrupted or corrupt download never leaves
    a file under the final name. Files already present with the right SHA256 are kept. Raises
    RuntimeError, listing every mirror's failure (network error or "SHA256 mismatch"), when no
    mirror gives a good copy of a file. progress=True shows a tqdm bar per file (if tqdm is installed).
    """
    info = _info(name)
    dest = Path(root) / name
    dest.mkdir(parents=True, exist_ok=True)
    for filename in info.filenames():
        target = dest / filename
        sha256 = info.sha256[filename]
        if target.is_file() and _digest(target, "sha256") == sha256:
            continue
        failures = []
        for mirror in info.mirrors:
            url = mirror + filename
            try:
                _fetch(url, target, sha256, progress)
                break
            except (OSError, http.client.HTTPException, ChecksumError) as e:
                failures.append(f"  {url}: {e}")
        else:
            raise RuntimeError(
                f"could not download {name} file {filename}; no file was written. Tried:\n"
                + "\n".join(failures)
            )
    return dest


_download = download  # the `download` arguments of find_dataset_files and load_dataset shadow it


def load_dataset(
    name: str, root: str | os.PathLike, split: str, download: bool = False, verify: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One split ("train" or "test") of a dataset: images uint8 (N, 1, H, W), labels int64 (N,).

    The files are located with `find_dataset_files`; when they are missing and download=True,
    they are first downloaded into root/<name>/. verify=True checks the found files' checksums
    (see `verify_files`) before reading them. Raises ValueError when the files are not an image
    and a label IDX file of uint8 with the same number of samples.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    files = find_dataset_files(name, root, download)
    if verify:
        verify_files(name, {split: files[split]})
    images_path, labels_path = files[split]
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(
            f"{images_path}: expected uint8 images (N, H, W), got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(
            f"{labels_path}: expected uint8 labels (N,), got {labels.dtype} {labels.shape}"
        )
    if len(images) != len(labels):
        raise ValueError(
            f"{name} {split}: {len(images)} images in {images_path} but {len(labels)} labels "
            f"in {labels_path}"
        )
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
