"""The stream a launch goes on: the caller's current stream, as Numba sees it."""

from __future__ import annotations

import functools

from ._device import SIMULATOR, cuda


@functools.lru_cache(maxsize=64)
def _numba_stream(ptr: int):
    return cuda.external_stream(ptr)


def current_stream(xp):
    """Numba stream for CuPy's current stream (0, the legacy default stream, when unset).

    Launching there keeps nbflash ordered with the caller's own work without any
    synchronisation.  The simulator has no streams.
    """
    if SIMULATOR or xp.__name__ == "numpy":
        return 0
    ptr = xp.cuda.get_current_stream().ptr
    return _numba_stream(ptr) if ptr else 0
