"""capsroute.datasets.mnist: IDX reading, dataset lookup, offline download.

No test uses the network: downloads go through a fake URL opener. The tests of the real MNIST and
Fashion-MNIST files read them from the shared data folder beside the checkout (../shared/data)
and are skipped where it is absent (e.g. CI on a clean clone); all the others use small IDX files
written here.
"""

import functools
import gzip
import hashlib
import io
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from capsroute.datasets import mnist

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]

# Written independently of capsroute.datasets.mnist's table, so that the round trip checks it.
TYPE_CODES = {
    np.uint8: 0x08,
    np.int8: 0x09,
    np.int16: 0x0B,
    np.int32: 0x0C,
    np.float32: 0x0D,
    np.float64: 0x0E,
}

FILES = mnist.DATASETS["mnist"].files  # the same four names for every registered dataset


def needs_shared(name):
    return pytest.mark.skipif(
        not (SHARED_DATA / name).is_dir(), reason=f"no shared data at {SHARED_DATA / name}"
    )


# ---------------------------------------------------------------------------------------------
# Helpers: IDX files, tiny datasets, a fake URL opener
# ---------------------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of array: magic, big-endian uint32 dims, big-endian elements."""
    header = (
        bytes([0, 0, TYPE_CODES[array.dtype.type], array.ndim])
        + np.asarray(array.shape, ">u4").tobytes()
    )
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = idx_bytes(array)
    path.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return path


def tiny_arrays(n_train=12, n_test=5, size=4):
    """split -> (uint8 images (N, size, size), uint8 labels (N,))."""
    rng = np.random.default_rng(0)
    return {
        split: (
            rng.integers(0, 256, (n, size, size), dtype=np.uint8),
            rng.integers(0, 10, n, dtype=np.uint8),
        )
        for split, n in (("train", n_train), ("test", n_test))
    }


def write_dataset(directory: Path, arrays, gz=True) -> None:
    """The four MNIST-named IDX files of arrays in directory, gzipped or not."""
    for split, names in FILES.items():
        for name, array in zip(names, arrays[split]):
            write_idx(directory / (name if gz else name.removesuffix(".gz")), array, gz)


def register_tiny(
    monkeypatch, arrays, mirrors=("https://first.invalid/", "https://second.invalid/")
):
    """Registers dataset "tiny" whose checksums are those of arrays' IDX files; returns name -> .gz bytes."""
    blobs, raw_md5 = {}, {}
    for split, names in FILES.items():
        for name, array in zip(names, arrays[split]):
            raw = idx_bytes(array)
            blobs[name] = gzip.compress(raw, mtime=0)
            raw_md5[name.removesuffix(".gz")] = hashlib.md5(raw).hexdigest()
    info = mnist.DatasetInfo(
        files=FILES,
        sha256={k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()},
        md5={k: hashlib.md5(v).hexdigest() for k, v in blobs.items()},
        raw_md5=raw_md5,
        mirrors=tuple(mirrors),
        torchvision_dir="Tiny",
    )
    monkeypatch.setitem(mnist.DATASETS, "tiny", info)
    return blobs


class FakeResponse(io.BytesIO):
    def __init__(self, payload: bytes):
        super().__init__(payload)
        self.headers = {"Content-Length": str(len(payload))}


def fake_opener(monkeypatch, table: dict[str, bytes]) -> list[str]:
    """Makes mnist._urlopen serve table (url -> bytes), any other URL being unreachable; returns the
    list of requested URLs."""
    requested = []

    def urlopen(url, timeout=None):
        requested.append(url)
        if url not in table:
            raise urllib.error.URLError("unreachable (test)")
        return FakeResponse(table[url])

    monkeypatch.setattr(mnist, "_urlopen", urlopen)
    return requested


def assert_no_files(directory: Path):
    assert not directory.exists() or list(directory.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# read_idx
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
@pytest.mark.parametrize(
    "dtype,shape",
    [
        (np.uint8, (3, 4, 5)),
        (np.int8, (7,)),
        (np.int16, (2, 3)),
        (np.int32, (4, 1, 2, 3)),
        (np.float32, (5, 2)),
        (np.float64, (3,)),
        (np.uint8, (0, 28, 28)),
    ],
)
def test_read_idx_round_trip(tmp_path, gz, dtype, shape):
    rng = np.random.default_rng(1)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    else:
        array = rng.standard_normal(shape).astype(dtype) * 1e3
    out = mnist.read_idx(write_idx(tmp_path / ("a.idx.gz" if gz else "a.idx"), array, gz))
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative and out.shape == shape
    np.testing.assert_array_equal(out, array)
    assert out.flags.writeable  # torch.from_numpy needs no copy or warning


def test_read_idx_recognises_gzip_by_content(tmp_path):
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    np.testing.assert_array_equal(
        mnist.read_idx(write_idx(tmp_path / "gz-without-suffix", array, True)), array
    )
    np.testing.assert_array_equal(
        mnist.read_idx(write_idx(tmp_path / "raw-with-suffix.gz", array, False)), array
    )


GOOD = idx_bytes(np.arange(24, dtype=np.int16).reshape(2, 3, 4))


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
@pytest.mark.parametrize(
    "content,message",
    [
        (GOOD[:-1], "truncated IDX payload"),
        (GOOD[:10], "truncated IDX header"),
        (GOOD[:3], "truncated IDX header"),
        (b"", "truncated IDX header"),
        (GOOD + b"\0\0", "2 unexpected trailing bytes"),
        (b"\x01" + GOOD[1:], "bad IDX magic number 0x010"),
        (b"\0\0\x0a" + GOOD[3:], "unknown IDX type code 0x0A"),
    ],
    ids=["payload", "dims", "magic", "empty", "trailing", "magic-byte", "type"],
)
def test_read_idx_errors_name_the_file_and_the_fault(tmp_path, gz, content, message):
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(gzip.compress(content) if gz else content)
    with pytest.raises(ValueError, match=message) as e:
        mnist.read_idx(path)
    assert str(path) in str(e.value)


def test_read_idx_truncated_gzip_stream(tmp_path):
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(GOOD)[:-12])
    with pytest.raises(ValueError, match="corrupt or truncated gzip stream") as e:
        mnist.read_idx(path)
    assert str(path) in str(e.value)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        mnist.read_idx(tmp_path / "nope.gz")


# ---------------------------------------------------------------------------------------------
# find_dataset_files
# ---------------------------------------------------------------------------------------------


def test_registry():
    assert set(mnist.DATASETS) == {"mnist", "fashion-mnist"}
    for name, info in mnist.DATASETS.items():
        assert set(info.files) == set(mnist.SPLITS)
        assert set(info.sha256) == set(info.md5) == set(info.filenames())
        assert set(info.raw_md5) == {f.removesuffix(".gz") for f in info.filenames()}
        assert info.mirrors and all(m.startswith("http") and m.endswith("/") for m in info.mirrors)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_registry_checksums_match_shared_sums_files(name):
    folder = SHARED_DATA / name
    if not folder.is_dir():
        pytest.skip(f"no shared data at {folder}")
    info = mnist.DATASETS[name]
    for sums, table in (("SHA256SUMS", info.sha256), ("MD5SUMS", info.md5)):
        listed = dict(
            reversed(line.split())
            for line in (folder / sums).read_text().splitlines()
            if line.strip()
        )
        assert listed == table


LAYOUTS = {
    "direct": lambda name: "",
    "named": lambda name: name,
    "torchvision": lambda name: f"{mnist.DATASETS[name].torchvision_dir}/raw",
}


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_find_dataset_files_layouts(tmp_path, name, layout, gz):
    arrays = tiny_arrays()
    folder = tmp_path / LAYOUTS[layout](name)
    write_dataset(folder, arrays, gz)
    found = mnist.find_dataset_files(name, tmp_path)
    assert set(found) == {"train", "test"}
    for split, (images, labels) in found.items():
        assert images.parent == folder and labels.parent == folder
        assert images.name.endswith(".gz") == gz
        np.testing.assert_array_equal(mnist.read_idx(images), arrays[split][0])
        np.testing.assert_array_equal(mnist.read_idx(labels), arrays[split][1])
    assert (tmp_path / "MNIST" / "raw").is_dir() == (name == "mnist" and layout == "torchvision")


def test_find_dataset_files_prefers_the_named_folder_and_gz(tmp_path):
    write_dataset(tmp_path, tiny_arrays())  # e.g. MNIST right in root ...
    write_dataset(
        tmp_path / "fashion-mnist", tiny_arrays(), gz=False
    )  # ... and Fashion-MNIST beside it
    write_dataset(tmp_path / "fashion-mnist", tiny_arrays(), gz=True)
    images, labels = mnist.find_dataset_files("fashion-mnist", tmp_path)["test"]
    assert images == tmp_path / "fashion-mnist" / "t10k-images-idx3-ubyte.gz"
    assert labels == tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz"
    assert (
        mnist.find_dataset_files("mnist", tmp_path)["train"][0]
        == tmp_path / "train-images-idx3-ubyte.gz"
    )


def test_find_dataset_files_mixed_gz_and_raw_in_one_folder(tmp_path):
    write_dataset(tmp_path, tiny_arrays(), gz=False)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", tiny_arrays()["train"][1], gz=True)
    found = mnist.find_dataset_files("mnist", tmp_path)
    assert found["train"] == (
        tmp_path / "train-images-idx3-ubyte",
        tmp_path / "train-labels-idx1-ubyte.gz",
    )


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_find_dataset_files_missing_message(tmp_path, name):
    write_dataset(tmp_path / name, tiny_arrays())
    (tmp_path / name / "t10k-labels-idx1-ubyte.gz").unlink()  # an incomplete copy is not used
    with pytest.raises(FileNotFoundError) as e:
        mnist.find_dataset_files(name, tmp_path)
    message = str(e.value)
    torchvision = mnist.DATASETS[name].torchvision_dir
    assert f"{tmp_path / name}: missing t10k-labels-idx1-ubyte.gz" in message
    assert f"{tmp_path / torchvision / 'raw'}: no such folder" in message
    assert f"{tmp_path}: missing train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz" in message
    assert "--data-dir" in message and "\n" not in message and "shared" not in message
    assert "--download" in message and str(tmp_path / name) in message


def test_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'cifar10'.*mnist, fashion-mnist"):
        mnist.find_dataset_files("cifar10", tmp_path)
    with pytest.raises(ValueError, match="unknown dataset"):
        mnist.download("cifar10", tmp_path)


# ---------------------------------------------------------------------------------------------
# download (fake opener, never the network)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("progress", [True, False])
def test_download_tries_the_mirrors_in_order(tmp_path, monkeypatch, progress):
    blobs = register_tiny(monkeypatch, tiny_arrays())
    requested = fake_opener(
        monkeypatch, {"https://second.invalid/" + k: v for k, v in blobs.items()}
    )
    dest = mnist.download("tiny", tmp_path, progress=progress)
    assert dest == tmp_path / "tiny"
    assert sorted(p.name for p in dest.iterdir()) == sorted(blobs)  # no temporary files left
    for name, blob in blobs.items():
        assert (dest / name).read_bytes() == blob
    filenames = mnist.DATASETS["tiny"].filenames()
    assert requested == [
        m + f for f in filenames for m in ("https://first.invalid/", "https://second.invalid/")
    ]
    # A second call finds good copies and fetches nothing.
    requested.clear()
    mnist.download("tiny", tmp_path, progress=progress)
    assert requested == []


def test_download_checksum_mismatch_leaves_no_file(tmp_path, monkeypatch):
    blobs = register_tiny(monkeypatch, tiny_arrays())
    corrupt = {k: v[:-1] + bytes([v[-1] ^ 1]) for k, v in blobs.items()}
    fake_opener(
        monkeypatch,
        {
            m + k: v
            for m in ("https://first.invalid/", "https://second.invalid/")
            for k, v in corrupt.items()
        },
    )
    with pytest.raises(RuntimeError) as e:
        mnist.download("tiny", tmp_path, progress=False)
    message = str(e.value)
    first = mnist.DATASETS["tiny"].filenames()[0]
    assert f"could not download tiny file {first}" in message
    assert (
        f"https://first.invalid/{first}: SHA256 mismatch: expected {mnist.DATASETS['tiny'].sha256[first]}"
        in message
    )
    assert f"https://second.invalid/{first}: SHA256 mismatch" in message
    assert_no_files(tmp_path / "tiny")


def test_download_unreachable_lists_every_mirror(tmp_path, monkeypatch):
    register_tiny(monkeypatch, tiny_arrays())
    fake_opener(monkeypatch, {})
    with pytest.raises(
        RuntimeError, match=r"(?s)first\.invalid.*unreachable.*second\.invalid.*unreachable"
    ):
        mnist.download("tiny", tmp_path, progress=False)
    assert_no_files(tmp_path / "tiny")


def test_download_falls_back_after_a_bad_copy_and_replaces_a_damaged_file(tmp_path, monkeypatch):
    blobs = register_tiny(monkeypatch, tiny_arrays())
    table = {"https://first.invalid/" + k: v[:10] for k, v in blobs.items()}  # truncated copies
    table.update({"https://second.invalid/" + k: v for k, v in blobs.items()})
    fake_opener(monkeypatch, table)
    damaged = tmp_path / "tiny" / "t10k-images-idx3-ubyte.gz"
    damaged.parent.mkdir()
    damaged.write_bytes(b"damaged")
    mnist.download("tiny", tmp_path, progress=False)
    for name, blob in blobs.items():
        assert (tmp_path / "tiny" / name).read_bytes() == blob


@needs_shared("mnist")
def test_download_real_mnist_bytes(tmp_path, monkeypatch):
    info = mnist.DATASETS["mnist"]
    fake_opener(
        monkeypatch,
        {info.mirrors[-1] + f: (SHARED_DATA / "mnist" / f).read_bytes() for f in info.filenames()},
    )
    dest = mnist.download("mnist", tmp_path, progress=False)
    for f in info.filenames():
        assert (dest / f).read_bytes() == (SHARED_DATA / "mnist" / f).read_bytes()
    images, labels = mnist.load_dataset("mnist", tmp_path, "test", verify=True)
    assert images.shape == (10000, 1, 28, 28) and labels.shape == (10000,)


# ---------------------------------------------------------------------------------------------
# load_dataset
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_load_dataset_tiny(tmp_path, gz):
    arrays = tiny_arrays()
    write_dataset(tmp_path / "MNIST" / "raw", arrays, gz)
    for split in ("train", "test"):
        images, labels = mnist.load_dataset("mnist", tmp_path, split)
        assert images.dtype == torch.uint8 and images.shape == (len(arrays[split][0]), 1, 4, 4)
        assert labels.dtype == torch.int64 and labels.shape == (len(arrays[split][1]),)
        assert torch.equal(images[:, 0], torch.from_numpy(arrays[split][0]))
        assert torch.equal(labels, torch.from_numpy(arrays[split][1]).long())
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        mnist.load_dataset("mnist", tmp_path, "valid")


def test_load_dataset_missing_without_download(tmp_path, monkeypatch):
    requested = fake_opener(monkeypatch, {})
    with pytest.raises(FileNotFoundError, match="--download"):
        mnist.load_dataset("mnist", tmp_path, "train")
    assert requested == []


def test_load_dataset_downloads_when_asked(tmp_path, monkeypatch):
    arrays = tiny_arrays()
    blobs = register_tiny(monkeypatch, arrays)
    fake_opener(monkeypatch, {"https://first.invalid/" + k: v for k, v in blobs.items()})
    images, labels = mnist.load_dataset("tiny", tmp_path, "train", download=True, verify=True)
    assert torch.equal(images[:, 0], torch.from_numpy(arrays["train"][0]))
    assert torch.equal(labels, torch.from_numpy(arrays["train"][1]).long())
    assert (tmp_path / "tiny" / "train-images-idx3-ubyte.gz").is_file()


@pytest.mark.parametrize("gz", [True, False], ids=["gz-sha256", "raw-md5"])
def test_load_dataset_verify(tmp_path, monkeypatch, gz):
    arrays = tiny_arrays()
    register_tiny(monkeypatch, arrays)
    write_dataset(tmp_path, arrays, gz)
    mnist.load_dataset("tiny", tmp_path, "test", verify=True)
    arrays["test"][1][0] ^= 1  # a different label: a valid IDX file, but not the published one
    write_dataset(tmp_path, arrays, gz)
    assert (
        mnist.load_dataset("tiny", tmp_path, "test")[1][0] == arrays["test"][1][0]
    )  # no check by default
    mnist.load_dataset(
        "tiny", tmp_path, "train", verify=True
    )  # only the split asked for is checked
    with pytest.raises(
        mnist.ChecksumError,
        match=f"t10k-labels-idx1-ubyte{'.gz' if gz else ''}: {'SHA256' if gz else 'MD5'} mismatch",
    ):
        mnist.load_dataset("tiny", tmp_path, "test", verify=True)


def test_load_dataset_count_and_format_mismatch(tmp_path):
    arrays = tiny_arrays()
    arrays["test"] = (arrays["test"][0], arrays["test"][1][:-1])
    write_dataset(tmp_path, arrays)
    with pytest.raises(ValueError, match="5 images .* but 4 labels"):
        mnist.load_dataset("mnist", tmp_path, "test")
    arrays["test"] = (arrays["test"][0].astype(np.int16), arrays["test"][1])
    write_dataset(tmp_path, arrays)
    with pytest.raises(ValueError, match="expected uint8 images"):
        mnist.load_dataset("mnist", tmp_path, "test")


@functools.lru_cache(maxsize=None)
def load_real(name, split):
    return mnist.load_dataset(name, SHARED_DATA, split, verify=True)


@needs_shared("mnist")
@pytest.mark.parametrize(
    "split,counts", [("train", MNIST_TRAIN_COUNTS), ("test", MNIST_TEST_COUNTS)]
)
def test_real_mnist(split, counts):
    images, labels = load_real("mnist", split)
    assert images.shape == (sum(counts), 1, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (sum(counts),) and labels.dtype == torch.int64
    assert torch.bincount(labels, minlength=10).tolist() == counts
    assert images.min() == 0 and images.max() == 255
    # The folder itself is also a valid root (the `--data-dir ../shared/data/mnist` layout).
    assert (
        mnist.find_dataset_files("mnist", SHARED_DATA / "mnist")[split][0].parent
        == SHARED_DATA / "mnist"
    )


@needs_shared("fashion-mnist")
@pytest.mark.parametrize("split,n", [("train", 60000), ("test", 10000)])
def test_real_fashion_mnist(split, n):
    images, labels = load_real("fashion-mnist", split)
    assert images.shape == (n, 1, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels, minlength=10).tolist() == [n // 10] * 10
    if (
        SHARED_DATA / "mnist"
    ).is_dir():  # same file names, different data: the right folder was used
        assert not torch.equal(images[:100], load_real("mnist", split)[0][:100])
