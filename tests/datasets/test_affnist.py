"""affnist (capsroute.datasets.affnist): the MAT level-5 reader and the affNIST test-set loader, on
small files in that format that the tests write (no affNIST file is needed)."""

import numpy as np
import pytest
import torch

from capsroute.datasets import affnist
from capsroute.datasets.affnist import MatError
from mat5 import affnist_struct, write_mat


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("order", ["<", ">"])
def test_read_mat_reads_arrays_and_structs(tmp_path, compress, order):
    matrix = np.arange(12, dtype=np.float64).reshape(3, 4)
    small = np.array([[7]], dtype=np.int32)  # 4 bytes: the small element format
    path = write_mat(
        tmp_path / "x.mat",
        {"m": matrix, "s": {"a": small, "b": np.arange(5, dtype=np.uint8)}},
        compress,
        order,
    )
    read = affnist.read_mat(path)
    assert read.keys() == {"m", "s"}
    assert np.array_equal(read["m"], matrix) and read["m"].dtype == np.float64
    assert np.array_equal(read["s"]["a"], small) and read["s"]["a"].dtype == np.int32
    assert np.array_equal(read["s"]["b"], np.arange(5)[None]) and read["s"]["b"].dtype == np.uint8


def test_the_test_set_loads_from_one_file_or_its_batches(tmp_path):
    data, images = affnist_struct(30)
    write_mat(tmp_path / "test.mat", {"affNISTdata": data})
    loaded = affnist.load_test(tmp_path)
    assert loaded.images.shape == (30, 1, 40, 40) and loaded.images.dtype == torch.uint8
    assert torch.equal(loaded.images[:, 0], torch.from_numpy(images))
    assert loaded.labels.tolist() == [k % 10 for k in range(30)]
    assert np.array_equal(
        loaded.transforms["human_readable_transform"], data["human_readable_transform"]
    )
    assert loaded.files == [tmp_path / "test.mat"]
    # test_batches.zip: 1.mat .. 32.mat, concatenated in order; `limit` reads only the first
    batches = tmp_path / "batches" / "test_batches"
    batches.mkdir(parents=True)
    for k in range(1, 33):
        write_mat(batches / f"{k}.mat", {"affNISTdata": affnist_struct(3, seed=k)[0]})
    both = affnist.load_test(tmp_path / "batches")
    assert len(both.labels) == 96 and both.transforms["affine_transform"].shape == (6, 96)
    assert torch.equal(both.images[3:6, 0], torch.from_numpy(affnist_struct(3, seed=2)[1]))
    first = affnist.load_test(tmp_path / "batches", limit=5)
    assert torch.equal(first.images, both.images[:5]) and len(first.files) == 32


def test_a_full_test_set_must_have_affnist_label_counts(tmp_path):
    labels = torch.cat([torch.full((32 * c,), d) for d, c in enumerate(affnist.MNIST_TEST_COUNTS)])
    good = affnist.AffNIST(torch.zeros(0), labels, {}, [tmp_path / "test.mat"])
    affnist.verify(good)
    bad = good._replace(labels=labels.roll(1000) % 9)
    with pytest.raises(MatError, match="are not affNIST's test set's"):
        affnist.verify(bad)


def _message(call) -> str:
    with pytest.raises((MatError, FileNotFoundError)) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_wrong_files_are_refused_in_one_line(tmp_path):
    assert "no affNIST test files in" in _message(lambda: affnist.load_test(tmp_path))
    (tmp_path / "test.mat").write_bytes(b"MATLAB 4 or anything else")
    assert "not a level-5 MAT file" in _message(lambda: affnist.load_test(tmp_path))
    (tmp_path / "test.mat").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(600))
    assert "MAT 7.3 (HDF5)" in _message(lambda: affnist.load_test(tmp_path))
    write_mat(tmp_path / "test.mat", {"other": np.zeros((2, 2))})
    assert "not an affNIST file" in _message(lambda: affnist.load_test(tmp_path))
    data, _ = affnist_struct(4)
    data["image"] = data["image"][:100]
    write_mat(tmp_path / "test.mat", {"affNISTdata": data})
    assert "must be 1600 x N uint8" in _message(lambda: affnist.load_test(tmp_path))
    data, _ = affnist_struct(4)
    data["label_int"] = data["label_int"] + 10
    write_mat(tmp_path / "test.mat", {"affNISTdata": data})
    assert "labels must be 0..9" in _message(lambda: affnist.load_test(tmp_path))
    whole = write_mat(tmp_path / "test.mat", {"affNISTdata": affnist_struct(4)[0]}).read_bytes()
    (tmp_path / "test.mat").write_bytes(whole[:-40])
    assert "test.mat" in _message(lambda: affnist.load_test(tmp_path))
