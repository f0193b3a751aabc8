"""The data sets capsroute trains on: MNIST and Fashion-MNIST from their IDX files (mnist), and
MultiMNIST pairs made from them (multimnist)."""

from . import mnist, multimnist
from .mnist import DATASETS, download, find_dataset_files, load_checked, load_dataset, read_idx
from .multimnist import MultiMNIST

__all__ = [
    "DATASETS",
    "MultiMNIST",
    "download",
    "find_dataset_files",
    "load_checked",
    "load_dataset",
    "mnist",
    "multimnist",
    "read_idx",
]
