import zlib

import pytest
import torch

import capsroute  # noqa: F401  (registers the ops)
from helpers import DEVICES


@pytest.fixture(autouse=True)
def seeded_rng(request):
    """Every test draws the same inputs on every run, whatever ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
