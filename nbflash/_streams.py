"""The stream a launch goes on: the caller's current stream, as a raw ``CUstream`` handle.

Kernels launch through :func:`nbflash._device.launch`, which takes the raw
handle (an ``int``) and hands it to the driver: no Numba stream object is made
on the hot path, and a launch inside CuPy's or PyTorch's stream capture is
recorded into the graph being captured.
"""

from __future__ import annotations

import contextlib
import functools

from ._device import SIMULATOR, cuda


@functools.lru_cache(maxsize=64)
def _numba_stream(ptr: int):
    return cuda.external_stream(ptr)


def current_stream(xp) -> int:
    """The raw handle of CuPy's current stream (0, the legacy default stream, when unset).

    Launching there keeps nbflash ordered with the caller's own work without any
    synchronisation.  The simulator has no streams: 0.
    """
    if SIMULATOR or xp.__name__ == "numpy":
        return 0
    return xp.cuda.get_current_stream().ptr


def numba_stream_from_ptr(ptr: int):
    """Numba stream for a raw CUDA stream handle, e.g. PyTorch's ``torch.cuda.current_stream().cuda_stream``.

    ``0`` (the legacy default stream) stays ``0``.  Call it with the stream's
    device current (see :func:`on_device`): Numba binds the wrapper to the
    current context the first time a handle is seen.  The simulator has no
    streams and always gets ``0``.
    """
    if SIMULATOR or not ptr:
        return 0
    return _numba_stream(int(ptr))


@contextlib.contextmanager
def on_device(index: int):
    """Make GPU ``index`` Numba's current device for the block (kernels launch on the current device).

    A no-op in the simulator.
    """
    if SIMULATOR:
        yield
        return
    with cuda.gpus[index]:
        yield


def array_device(xp, a):
    """A context in which kernels launch on the GPU holding ``a`` and CuPy allocates there.

    Nothing to do (and nothing paid) when that GPU is already current, which
    is the common single-GPU case.
    """
    if SIMULATOR or xp.__name__ == "numpy":
        return contextlib.nullcontext()
    index = a.device.id
    if index == xp.cuda.runtime.getDevice():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(xp.cuda.Device(index))
    stack.enter_context(on_device(index))
    return stack
