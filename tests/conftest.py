"""Test set-up: run in Numba's CUDA simulator unless a GPU is present (see nbflash._device)."""

import sys
import zlib

import numpy as np
import pytest

import nbflash
from nbflash._device import SIMULATOR

# The simulator switches Python threads at every syncthreads; a short switch
# interval makes that much faster.
sys.setswitchinterval(1e-4)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (running in the simulator)")
    for item in items:
        if "gpu" in item.keywords and SIMULATOR:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request):
    """Random inputs drawn afresh for every test (seeded by the test's id, so a failure reproduces)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def xp():
    """The array module the kernels run on here: NumPy in the simulator, CuPy on a GPU."""
    if nbflash.SIMULATOR:
        return np
    import cupy

    return cupy
