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

if SIMULATOR:
    import threading
    import traceback

    from numba.cuda import types as _types
    from numba.cuda.np import numpy_support as _numpy_support
    from numba.cuda.simulator import kernelapi as _kernelapi

    _dynamic_or_unlocked = _kernelapi.FakeCUDAShared.array
    _first_use = threading.Lock()

    def _static_shared_array(self, shape, dtype, alignment=None):
        """The simulator's ``cuda.shared.array``, with a static array's first-use allocation under a lock.

        numba-cuda's simulator makes a static shared array when the first thread of a block reaches its line
        (looked up, then created, with no lock): with the short switch interval above, two threads can each
        make one, and then they do not share memory.  nbflash's kernels use dynamic shared memory only (one
        buffer per block, no race); some test kernels declare static arrays.
        """
        if shape == 0:
            return _dynamic_or_unlocked(self, shape, dtype, alignment)
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, _types.Type):
            dtype = _numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe())[-2][0:2])  # the kernel's line, as numba keys it
        with _first_use:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = np.empty(shape, dtype)
        return array

    _kernelapi.FakeCUDAShared.array = _static_shared_array


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (running in the simulator)")
    for item in items:
        if "gpu" in item.keywords and SIMULATOR:
            item.add_marker(skip_gpu)
    # The offline compiles (minutes each) spread evenly over the first two thirds of the order.  pytest-xdist
    # hands each worker runs of consecutive tests in this order: spread out, the compiles land on every worker,
    # and none is left near the end, where one worker would finish it while the other idles (in file order the
    # forward's sm_90a check came at 60 % and ran about 16 minutes past the rest).
    offline = [item for item in items if "offline" in item.keywords]
    rest = [item for item in items if "offline" not in item.keywords]
    every = max(1, 2 * len(rest) // 3 // max(1, len(offline)))
    order = []
    for i, item in enumerate(rest):
        if i % every == 0 and i // every < len(offline):
            order.append(offline[i // every])
        order.append(item)
    items[:] = order + offline[len(order) - len(rest):]


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
