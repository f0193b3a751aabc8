"""The data sets capsroute trains on: MNIST and Fashion-MNIST from their IDX files (mnist),
MultiMNIST pairs made from them (multimnist), MNIST test digits under random affine
transformations (affine_mnist, "affine-mnist", generated) and the published affNIST test files
(affnist, read where a user has them)."""

from . import affine_mnist, affnist, mnist, multimnist
from .affine_mnist import AffineMNIST
from .mnist import DATASETS, download, find_dataset_files, load_checked, load_dataset, read_idx
from .multimnist import MultiMNIST

__all__ = [
    "AffineMNIST",
    "DATASETS",
    "MultiMNIST",
    "affine_mnist",
    "affnist",
    "download",
    "find_dataset_files",
    "load_checked",
    "load_dataset",
    "mnist",
    "multimnist",
    "read_idx",
]
