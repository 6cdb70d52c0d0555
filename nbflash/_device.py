"""The one place nbflash touches ``numba.cuda``.

Every kernel module imports ``cuda`` (and the few warp-level helpers below)
from here, so three things are decided once:

* **GPU or simulator.** Numba's CUDA simulator is switched on by the
  environment variable ``NUMBA_ENABLE_CUDASIM=1`` *before* Numba is imported;
  on a machine with no CUDA driver at all, nbflash sets it for you (unless
  the variable is set either way).  :data:`SIMULATOR` records which one we got.  Kernels are the same source in
  both cases; only the handful of warp primitives the simulator lacks get a
  Python implementation here, with the hardware's semantics.
* **Compilation.** :func:`kernel` and :func:`device_function` wrap
  ``cuda.jit`` with the project's options.
* **The on-disk cache.** On a GPU every kernel is cached on disk by Numba
  (``NBFLASH_DISK_CACHE=0`` turns it off), under a key that covers everything
  that shapes its code, so two tile configurations are never confused; see
  :class:`_KernelCache`.
* **Numba-CUDA internals.** Raising a kernel's dynamic shared-memory limit and
  compiling to PTX without a GPU need calls numba-cuda has no public API for;
  they live in :func:`set_max_dynamic_shared` and :func:`compile_ptx_offline`.
* **ptxas without a GPU.** :func:`ptxas_info` assembles PTX through nvJitLink
  and reads registers, spills and stack from ptxas' log
  (:func:`parse_ptxas_log`), for the offline compile tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import io
import os
import re
import sys
import threading
import warnings
import weakref
from pathlib import Path


def _cuda_driver_present() -> bool:
    """Can the CUDA driver library be loaded at all?"""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


# With no GPU driver on this machine and no explicit choice, run in the
# simulator: the same kernels, on NumPy arrays.  An explicit
# NUMBA_ENABLE_CUDASIM (0 or 1) always wins.  Numba reads the variable when it
# is first imported, so this only helps if nbflash is imported before Numba.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba" not in sys.modules and not _cuda_driver_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numba  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda import cgutils  # noqa: E402
from numba.cuda.core import config as _cuda_config  # noqa: E402
from numba.cuda.core import targetconfig as _targetconfig  # noqa: E402

# ``@intrinsic`` lets a kernel module emit inline PTX (see nbflash.intrinsics);
# re-exported here so that module, too, needs nothing from numba.cuda directly.
from numba.cuda.extending import intrinsic  # noqa: E402

__all__ = [
    "SIMULATOR",
    "cgutils",
    "cuda",
    "device_function",
    "intrinsic",
    "kernel",
    "shfl_xor",
    "syncwarp",
    "any_lane",
    "is_available",
    "set_max_dynamic_shared",
    "compile_ptx_offline",
    "parse_ptxas_log",
    "ptxas_info",
    "PtxasError",
    "disk_cache_enabled",
    "disk_cache_stats",
    "numba",
    "target_cc",
]

# Small grids are normal here (one head, a short sequence); Numba's
# low-occupancy warning would fire on every such call.
_cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

#: True when kernels run in Numba's CUDA simulator (one Python thread per CUDA thread).
SIMULATOR: bool = bool(_cuda_config.ENABLE_CUDASIM)

#: Lanes per warp; the warp helpers below assume the hardware's 32.
WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF


def is_available() -> bool:
    """True if kernels can run: a CUDA GPU is present, or the simulator is on."""
    if SIMULATOR:
        return True
    try:
        return bool(cuda.is_available())
    except Exception:  # pragma: no cover - driver problems mean "no GPU"
        return False


def kernel(fn=None, **options):
    """``cuda.jit`` for a kernel (used as a decorator inside kernel factories).

    ``launch_bounds=(threads, min_blocks)`` caps registers so that many blocks
    fit on a multiprocessor; the simulator has no such option and ignores it.
    On a GPU the kernel is cached on disk unless ``NBFLASH_DISK_CACHE=0``
    (see :class:`_KernelCache`).
    """
    if SIMULATOR or options.get("launch_bounds") is None:
        options.pop("launch_bounds", None)
    if fn is None:
        return lambda f: kernel(f, **options)
    dispatcher = cuda.jit(**options)(fn)
    if not SIMULATOR:
        _KERNELS.add(dispatcher)
        if disk_cache_enabled():
            _enable_disk_cache(dispatcher)
    return dispatcher


def device_function(fn, *, nvvm_inline: bool = False):
    """A helper called from kernels: ``cuda.jit(device=True)``, always inlined.

    By default Numba inlines it into each caller's Numba IR (``inline="always"``), which lets
    Numba type the body with the caller's constants.  With ``nvvm_inline=True`` it is compiled
    once, as a function of its own, and NVVM inlines it (``forceinline``: LLVM's
    ``alwaysinline``).  That is for a function called many times over, such as a chain of
    unrolled k-steps: Numba's IR inlining deep-copies the callee's IR at every call site, so a
    chain of n calls, each inlining the one before, costs O(n²) copies, while NVVM's inliner
    sees each function once.  Elsewhere Numba's IR inlining is kept: with every helper inlined
    by NVVM instead, ptxas spilled in the forward at D = 128 and the kernels gained ldmatrix.
    """
    if nvvm_inline and not SIMULATOR:  # the simulator calls it as Python either way
        return cuda.jit(device=True, forceinline=True)(fn)
    return cuda.jit(device=True, inline="always")(fn)


# --------------------------------------------------------------------------
# Warp primitives.  On the GPU these are Numba's own; the simulator has none,
# so we give it an implementation with the same per-lane semantics.
# --------------------------------------------------------------------------


class _SimWarp:
    """Exchange slots and a barrier shared by the simulated lanes of one warp."""

    def __init__(self, lanes: int):
        self.barrier = threading.Barrier(lanes)
        self.slots = [None] * WARP_SIZE


_sim_lock = threading.Lock()


def _sim_warp():
    """The calling simulator thread's lane index and its warp's exchange state."""
    thread = threading.current_thread()
    manager = thread._manager  # the simulator's BlockManager for this block
    tid = thread.thread_id
    warp_id, lane = divmod(tid, WARP_SIZE)
    with _sim_lock:
        warps = manager.__dict__.setdefault("_nbflash_warps", {})
        warp = warps.get(warp_id)
        if warp is None:
            bx, by, bz = manager._block_dim
            nthreads = bx * by * bz
            lanes = min(WARP_SIZE, nthreads - warp_id * WARP_SIZE)
            warp = warps[warp_id] = _SimWarp(lanes)
    return lane, warp


def _sim_shfl_xor(mask, value, lane_mask):
    """``shfl.sync.bfly``: every lane receives the value of lane ``lane ^ lane_mask``."""
    lane, warp = _sim_warp()
    warp.slots[lane] = value
    warp.barrier.wait()  # all lanes have published their value
    out = warp.slots[lane ^ lane_mask]
    warp.barrier.wait()  # all lanes have read before anyone overwrites a slot
    return out


def _sim_warp_uniform(value):
    """``shfl.sync.idx`` from lane 0: lane 0's ``value`` in every lane of the warp."""
    lane, warp = _sim_warp()
    warp.slots[lane] = value
    warp.barrier.wait()  # all lanes have published their value
    out = warp.slots[0]
    warp.barrier.wait()  # all lanes have read before anyone overwrites a slot
    return out


def _sim_any_lane(predicate):
    """``vote.sync.any``: true in every lane iff ``predicate`` is true in at least one lane of the warp."""
    lane, warp = _sim_warp()
    warp.slots[lane] = bool(predicate)
    warp.barrier.wait()  # all lanes have published their predicate
    out = any(x is True for x in warp.slots)  # every active lane has just written its own slot
    warp.barrier.wait()  # all lanes have read before anyone overwrites a slot
    return out


def _sim_syncwarp(mask=FULL_MASK):
    """``bar.warp.sync``: the lanes of the calling warp wait for each other."""
    _, warp = _sim_warp()
    warp.barrier.wait()


if SIMULATOR:
    shfl_xor = _sim_shfl_xor
    syncwarp = _sim_syncwarp
    warp_uniform = _sim_warp_uniform
    any_lane = _sim_any_lane
else:

    @device_function
    def shfl_xor(mask, value, lane_mask):
        return cuda.shfl_xor_sync(mask, value, lane_mask)

    @device_function
    def warp_uniform(value):
        """Lane 0's ``value`` in every lane (``shfl.sync.idx``): the same number, but now the compiler knows that
        all lanes of the warp agree on it (as CUTLASS's ``canonical_warp_group_idx``).  A branch on it is not
        divergent, so ptxas need not serialise the wgmmas inside it."""
        return cuda.shfl_sync(FULL_MASK, value, 0)

    @device_function
    def syncwarp():
        cuda.syncwarp(FULL_MASK)

    @device_function
    def any_lane(predicate):
        """``vote.sync.any`` over the whole warp: the same answer in every lane, so a branch on it is uniform."""
        return cuda.any_sync(FULL_MASK, predicate)


# --------------------------------------------------------------------------
# The on-disk kernel cache.
# --------------------------------------------------------------------------
#
# Compiling one kernel configuration takes 3–13 s; Numba can keep the cubin on
# disk and load it in a later process in well under a second.  Numba's own key
# (numba/cuda/core/caching.py, Cache._index_key) is the signature, the CUDA
# runtime version and compute capability, the numba-cuda version, a hash of the
# kernel's bytecode and a hash of its closure cells pickled by cloudpickle.
# For nbflash's per-configuration closures that is not enough:
#
# * an @intrinsic (the tensor-core kernels' inline PTX) pickles with a
#   per-process uuid (numba/cuda/extending.py, _Intrinsic._reduce_states), so
#   the tensor-core kernels would get a new key in every process: never a hit,
#   and one more file each time;
# * the target options (fastmath, launch_bounds, opt, debug, lineinfo) are not
#   in it: two forward configurations that differ only in ``min_blocks`` (the
#   launch bounds) would share one entry;
# * the module globals a kernel reads, and the helpers pickle stores by name
#   (module-level functions: a masking rule, an intrinsic's code generator),
#   are not in it, and the index is stamped with the kernel's own file only:
#   after an edit of masking.py the old kernel would load;
# * all configurations of a kernel share one index file, which Numba updates
#   read-modify-write without a lock: two processes saving two configurations
#   at once can leave one configuration's key pointing at the other's cubin.
#
# So each kernel gets a :class:`_KernelCache` keyed by
#     (signature, (CUDA runtime version, compute capability), numba-cuda version, fingerprint)
# where the fingerprint hashes, with Numba's pickler minus the intrinsic uuids,
# the kernel's code object, its closure cells (the tile constants, the device
# functions made for this configuration, each pickled with its own code,
# closure, globals and options), the module globals it reads, its target
# options, and the text of every nbflash source file.  Equal fingerprints mean
# equal compiler input, so the same code.  Each key has its own index and data
# file (their name ends in a hash of the key) and Numba writes every file under
# a temporary name and renames it into place, so concurrent processes
# (pytest -n 8) can only ever replace an entry by an equal one.
#
# Still outside the key, as in Numba's: compiler settings read from the
# environment at compile time rather than through target options, and an NVVM
# upgrade that leaves the CUDA runtime version unchanged.  Since every edit of
# nbflash makes new keys, hence new file names, the files of older versions
# stay until someone deletes them (Numba's shared index would overwrite them).

#: Values of ``NBFLASH_DISK_CACHE`` that turn the disk cache off.
_OFF = ("0", "false", "no", "off")

#: Every kernel made by :func:`kernel` in this process (for :func:`disk_cache_stats`).
_KERNELS: weakref.WeakSet = weakref.WeakSet()


def disk_cache_enabled() -> bool:
    """Will kernels created from now on be cached on disk?  On a GPU unless ``NBFLASH_DISK_CACHE=0``, never simulated.

    Where: Numba's usual place — ``$NUMBA_CACHE_DIR`` if set, else ``__pycache__``
    next to the kernel's source file if writable, else the user's cache directory
    (``~/.cache/numba``).
    """
    return _CACHE_SUPPORTED and os.environ.get("NBFLASH_DISK_CACHE", "1").strip().lower() not in _OFF


def disk_cache_stats() -> dict:
    """``{"kernels", "hits", "misses", "missed"}``: compiled signatures served from disk and compiled afresh, in
    this process; ``missed`` names the kernels that were compiled.

    ``kernels`` counts the kernels created so far (each may have several signatures).
    """
    kernels = list(_KERNELS)
    hits = sum(sum(k._cache_hits.values()) for k in kernels)
    misses = sum(sum(k._cache_misses.values()) for k in kernels)
    missed = sorted(k.py_func.__name__ for k in kernels if sum(k._cache_misses.values()))
    return dict(kernels=len(kernels), hits=hits, misses=misses, missed=missed)


def _enable_disk_cache(dispatcher) -> None:
    """Give ``dispatcher`` a :class:`_KernelCache` (what ``cuda.jit(cache=True)`` does with Numba's own cache)."""
    try:
        dispatcher._cache = _KernelCache(dispatcher)
    except Exception:  # e.g. Numba found no writable cache directory: compile every time
        pass


@functools.cache
def _source_digest() -> str:
    """sha256 of the text of nbflash's source files: any edit of nbflash invalidates every cached kernel."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _global_names(code) -> set[str]:
    """Names ``code`` (and the code objects nested in it) may look up as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def kernel_fingerprint(dispatcher) -> str:
    """The hash that identifies a kernel's compiler input across processes (the heart of its disk-cache key)."""
    py_func = dispatcher.py_func
    cells = tuple(cell.cell_contents for cell in py_func.__closure__ or ())
    module = py_func.__globals__
    globals_read = {name: module[name] for name in sorted(_global_names(py_func.__code__)) if name in module}
    options = tuple(sorted(dispatcher.targetoptions.items()))
    with io.BytesIO() as buf:
        _StablePickler(buf, protocol=4).dump((py_func.__code__, cells, globals_read, options))
        return hashlib.sha256(_source_digest().encode() + buf.getvalue()).hexdigest()


try:  # numba-cuda internals (0.30.x): without them nbflash just compiles every time
    if SIMULATOR:
        raise ImportError("no disk cache in the simulator")
    import numba_cuda
    from llvmlite.ir import Type as _LLVMType
    from numba.core.types import Type as _NumbaType
    from numba.cuda.core.caching import IndexDataCacheFile
    from numba.cuda.dispatcher import CUDACache
    from numba.cuda.extending import _Intrinsic
    from numba.cuda.serialize import NumbaPickler
except ImportError:
    _CACHE_SUPPORTED = False
else:
    _CACHE_SUPPORTED = True

if _CACHE_SUPPORTED:

    class _StablePickler(NumbaPickler):
        """Numba's pickler (cloudpickle; a dispatcher pickles as its Python function and options), except that
        an ``@intrinsic`` pickles as its name and definition, without the per-process uuid Numba gives it.

        Only ever used to hash, never to unpickle.
        """

        def reducer_override(self, obj):
            if isinstance(obj, _Intrinsic):
                return _Intrinsic, (obj._name, obj._defn)
            if isinstance(obj, _NumbaType):
                # A Numba type pickles with its __dict__, which typing fills with caches as kernels compile:
                # the same type would hash differently before and after the first compilation in a process.
                # Its class and name identify it (types are interned by them).
                return str, (f"numba type {type(obj).__module__}.{type(obj).__qualname__}:{obj.name}",)
            if isinstance(obj, _LLVMType):  # the same: llvmlite caches its text form in the instance
                return str, (f"llvm type {obj}",)
            return super().reducer_override(obj)

    class _KernelCache(CUDACache):
        """Numba's CUDA disk cache for one kernel, keyed by :func:`kernel_fingerprint`, one index file per key.

        The files live where Numba's locator puts them (see :func:`disk_cache_enabled`), named
        ``<module>.<qualname>-<line>.py<ver>-<key hash>.nbi`` (the index) and ``....1.nbc`` (the cubin).
        A load that fails for any reason is a miss; a save that fails is skipped, with a warning.
        """

        def __init__(self, dispatcher):
            self._dispatcher = weakref.ref(dispatcher)
            self._fingerprint = None
            super().__init__(dispatcher.py_func)

        def _index_key(self, sig, codegen):
            if self._fingerprint is None:
                self._fingerprint = kernel_fingerprint(self._dispatcher())
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._fingerprint)
            if self._launch_config_key is not None:  # Numba's launch-config-sensitive kernels (none here)
                key += (("launch_config", self._launch_config_key),)
            return key

        def _entry(self, key) -> IndexDataCacheFile:
            """The index and data files of ``key`` alone."""
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
            stamp = self._impl.locator.get_source_stamp()
            return IndexDataCacheFile(self._cache_path, f"{self._impl.filename_base}-{digest}", stamp)

        def _load_overload(self, sig, target_context):
            if not self._enabled:
                return None
            try:
                key = self._index_key(sig, target_context.codegen())
                data = self._entry(key).load(key)
                return None if data is None else self._impl.rebuild(target_context, data)
            except Exception:  # a truncated or foreign file: compile instead (and overwrite it)
                return None

        def _save_overload(self, sig, data):
            if not self._enabled:
                return
            try:
                self._impl.locator.ensure_cache_path()
                key = self._index_key(sig, data.codegen)
                self._entry(key).save(key, self._impl.reduce(data))
            except Exception as e:  # e.g. a kernel whose closure cannot be pickled: it just is not cached
                self.disable()
                warnings.warn(f"nbflash: not caching {self._name} on disk: {type(e).__name__}: {e}", stacklevel=2)


# --------------------------------------------------------------------------
# numba-cuda internals, wrapped once.
# --------------------------------------------------------------------------

#: Shared memory a block may use without opting in (bytes).
DEFAULT_SHARED_LIMIT = 48 * 1024


@functools.cache
def _device_properties(index: int) -> tuple[tuple[int, int], int, int]:
    """(compute capability, opt-in shared memory per block, multiprocessors) of GPU ``index``, asked once."""
    dev = cuda.gpus[index]
    return tuple(dev.compute_capability), int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), int(dev.MULTIPROCESSOR_COUNT)


def _current_index() -> int:
    """The current CUDA context's device ordinal (one driver call, no Numba device object)."""
    return (_fast_path or _load_fast_path()).current_device()


def compute_capability() -> tuple[int, int] | None:
    """The current device's compute capability, or None in the simulator (which has no tensor cores)."""
    if SIMULATOR:
        return None
    return _device_properties(_current_index())[0]


def max_shared_per_block() -> int:
    """The current device's opt-in shared-memory limit per block (bytes)."""
    if SIMULATOR:
        return 227 * 1024
    return _device_properties(_current_index())[1]


#: The simulator's multiprocessors: few, so that a persistent kernel's blocks each take several work items.
SIM_MULTIPROCESSORS = 2


def multiprocessor_count() -> int:
    """The current device's streaming multiprocessors (the grid of a persistent kernel)."""
    if SIMULATOR:
        return SIM_MULTIPROCESSORS
    return _device_properties(_current_index())[2]


def set_max_dynamic_shared(dispatcher, nbytes: int) -> None:
    """Let every compiled overload of ``dispatcher`` launch with ``nbytes`` of dynamic shared memory.

    A block may use more than 48 KB of shared memory only after the kernel's
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` is raised; numba-cuda has
    no API for that attribute, so we set it through the driver binding on the
    compiled function (the call numba-cuda itself makes for its carveout option).
    A no-op in the simulator, which has no such limit.
    """
    if SIMULATOR or nbytes <= DEFAULT_SHARED_LIMIT:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for overload in dispatcher.overloads.values():
        cufunc = overload._codelibrary.get_cufunc()
        driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)


def max_dynamic_shared(dispatcher) -> list[int]:
    """The dynamic shared-memory limit of each compiled overload (for tests)."""
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    out = []
    for overload in dispatcher.overloads.values():
        cufunc = overload._codelibrary.get_cufunc()
        out.append(int(driver.cuKernelGetAttribute(attr, cufunc.handle, cufunc.device.id)))
    return out


class _SimArray:
    """A strided NumPy view handed to a simulated kernel as it is.

    The simulator copies each NumPy argument "to the device" and back, which it
    can only do for contiguous arrays; a kernel only indexes its arrays and
    reads their shape and strides (and :func:`nbflash.intrinsics.global_address`
    their data address), so a view that forwards those works in place.
    """

    __slots__ = ("_a", "shape", "dtype", "strides", "itemsize", "ctypes")

    def __init__(self, a):
        self._a = a
        self.shape = a.shape
        self.dtype = a.dtype
        self.strides = a.strides
        self.itemsize = a.itemsize
        self.ctypes = a.ctypes

    def __getitem__(self, idx):
        return self._a[idx]

    def __setitem__(self, idx, value):
        self._a[idx] = value


def launch(dispatcher, grid, block, stream, shared_bytes: int, *args) -> None:
    """Launch a kernel with ``shared_bytes`` of dynamic shared memory on ``stream``.

    ``stream``: a raw ``CUstream`` handle (``int``; 0 is the legacy default
    stream) or a Numba stream object.  On the GPU the launch goes through the
    fast path of :mod:`nbflash._launch` — compiled once per argument
    signature, with the dynamic shared-memory limit raised before the first
    launch, then one ``cuLaunchKernel`` per call; arguments it cannot describe
    (NumPy arrays to be copied, records, ...) go through Numba's dispatcher as
    before.  In the simulator, strided NumPy views are passed through in place.
    """
    if SIMULATOR:
        args = tuple(
            _SimArray(a) if hasattr(a, "flags") and not a.flags.c_contiguous and a.ndim > 0 else a for a in args
        )
        dispatcher[grid, block, 0, shared_bytes](*args)
        return
    fast = _fast_path or _load_fast_path()
    launches = fast.recording()
    if launches is not None:  # recording a recipe (nbflash._launch.record): nothing runs
        launches.append((dispatcher, grid, block, shared_bytes, args))
        return
    handle = stream if type(stream) is int else stream_handle(stream)
    if any(type(a) is fast.Derived for a in args):  # made now, for this launch's stream (a recipe: per replay)
        device = fast.current_device()
        args = tuple(a.make(a.sources, handle, device) if type(a) is fast.Derived else a for a in args)
    if fast.launch(dispatcher, grid, block, handle, shared_bytes, args):
        return
    dispatcher_launch(dispatcher, grid, block, stream, shared_bytes, *args)


def dispatcher_launch(dispatcher, grid, block, stream, shared_bytes: int, *args) -> None:
    """Launch through Numba's dispatcher (types and marshals every argument on every call).

    The route for arguments the fast path cannot describe, and the baseline the
    overhead benchmark compares with.  ``stream`` may be a raw handle.
    """
    if type(stream) is int and stream:
        stream = cuda.external_stream(stream)
    sig = tuple(dispatcher.typeof_pyval(a) for a in args)
    if sig not in dispatcher.overloads:
        dispatcher.compile(sig)
        set_max_dynamic_shared(dispatcher, shared_bytes)
    dispatcher[grid, block, stream, shared_bytes](*args)


_fast_path = None


def _load_fast_path():
    """Import :mod:`nbflash._launch` (it imports this module, so not at the top)."""
    global _fast_path
    from . import _launch

    _fast_path = _launch
    return _launch


def stream_handle(stream) -> int:
    """The raw ``CUstream`` handle of a Numba (or ``cuda.core``) stream object, or of an ``int``; 0 for None."""
    if stream is None or type(stream) is int:
        return stream or 0
    return int(getattr(stream, "handle", stream) or 0)


# The fast path's needs from numba-cuda: types for a signature, the compiled kernel's handle.


def numba_types():
    """Numba's type module (``numba.cuda.types``)."""
    from numba.cuda import types

    return types


def array_type(dtype, ndim: int, layout: str):
    """The Numba type of a mutable device array: ``Array(dtype, ndim, layout)``."""
    from numba.cuda.np import numpy_support

    return numba_types().Array(numpy_support.from_dtype(dtype), ndim, layout)


_SCALAR_CODES = {
    "d": "float64",
    "f": "float32",
    "e": "float16",
    "?": "boolean",
    "b": "int8",
    "h": "int16",
    "i": "int32",
    "q": "int64",
    "B": "uint8",
    "H": "uint16",
    "I": "uint32",
    "Q": "uint64",
}


def scalar_type(code: str):
    """The Numba type of a scalar argument from its ``struct`` code (``"d"`` -> float64, ``"?"`` -> boolean, ...)."""
    return getattr(numba_types(), _SCALAR_CODES[code])


def kernel_handle(dispatcher, argtypes, device: int, shared_bytes: int) -> int:
    """Compile ``dispatcher`` for ``argtypes`` (once), load it on GPU ``device``; its ``CUkernel`` handle.

    Raises the kernel's dynamic shared-memory limit to ``shared_bytes`` on that
    device first (see :func:`set_max_dynamic_shared`).  Kernels compiled with
    ``debug`` (exception reporting), cooperative launch or argument extensions
    need Numba's own launch and raise ``NotImplementedError``.
    """
    from numba.cuda.cudadrv.driver import binding, driver

    with cuda.gpus[device]:
        kernel = dispatcher.compile(tuple(argtypes))
        if kernel.debug or kernel.cooperative or kernel.extensions:
            raise NotImplementedError("debug, cooperative or extended kernels need Numba's launch")
        cufunc = kernel._codelibrary.get_cufunc()
        if shared_bytes > DEFAULT_SHARED_LIMIT:
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, int(shared_bytes), cufunc.handle, cufunc.device.id)
        return int(cufunc.handle)


def ensure_context() -> None:
    """Make a CUDA context current on this thread (Numba's primary context of the current device)."""
    cuda.current_context()


@contextlib.contextmanager
def _pretend_device(cc):
    """Report compute capability ``cc`` to numba-cuda's device-function compiler.

    numba-cuda asks the driver for the current device's compute capability when
    a kernel calls a ``@cuda.jit(device=True)`` function, which fails on a
    machine with no GPU.  For an offline PTX compile we answer for it.
    """
    import numba.cuda.dispatcher as disp

    class _Dev:
        compute_capability = cc

    saved = disp.get_current_device
    disp.get_current_device = lambda: _Dev()
    try:
        yield
    finally:
        disp.get_current_device = saved


def target_cc() -> tuple[int, int]:
    """The compute capability being compiled for — call it only inside an intrinsic's code generator."""
    return tuple(_targetconfig.ConfigStack().top().compute_capability)


def compile_ptx_offline(pyfunc, signature, cc=(9, 0), **options) -> str:
    """Compile a kernel's Python source to PTX with NVVM; needs no GPU.

    The simulator does not type-check kernels, so this is how CI proves that the
    real kernels compile.  Must be called without the simulator active.
    """
    if SIMULATOR:
        raise RuntimeError("compile_ptx_offline needs the real numba-cuda, not the simulator")
    with _pretend_device(cc):
        ptx, _ = cuda.compile_ptx(pyfunc, signature, cc=cc, **options)
    return ptx


# --------------------------------------------------------------------------
# ptxas through nvJitLink: registers, spills and stack of compiled PTX, no GPU.
# --------------------------------------------------------------------------

_USED_REGISTERS = re.compile(r"[Uu]sed (\d+) registers([^\n]*)")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def parse_ptxas_log(log: str) -> dict:
    """Registers, spills, stack and shared memory from a ``ptxas -verbose`` info log.

    The log nvJitLink returns looks like this (then a linker summary, whose
    ``used … registers`` line comes after ptxas' and whose ``smem`` on sm_90
    includes the 1 KB the system reserves)::

        ptxas info    : Compiling entry function 'add_one' for 'sm_90'
        ptxas info    : Function properties for add_one
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 8 registers, used 1 barriers, 256 bytes smem

    Each field is read from its *first* occurrence, i.e. ptxas' report of the
    first function in the module (nbflash's PTX holds one kernel).  When
    nvJitLink reuses a result from its on-disk cache, ptxas does not run and
    only the linker's summary is there (``used 32 registers, used 1 barriers,
    0 stack, 17416 bytes smem, 728 bytes cmem[0], 0 bytes lmem``): the stack
    then comes from ``N stack``, and ``spill_bytes`` is the local memory per
    thread (``N bytes lmem``), stack frame included — exact when it is 0, an
    upper bound otherwise; ``spill_stores``/``spill_loads`` stay None.  Returns
    ``registers``, ``spill_stores``, ``spill_loads``, ``spill_bytes`` (stores +
    loads), ``stack_bytes``, ``shared_bytes`` (static shared memory; 0 when the
    registers line names none), ``barriers`` and ``function`` (the entry's
    name); a field the log does not have is None.  ``log`` is the text itself.
    """
    used = _USED_REGISTERS.search(log)
    spills = _SPILLS.search(log)
    stack = _STACK.search(log)
    entry = _ENTRY.search(log)
    rest = used.group(2) if used else ""
    smem = re.search(r"(\d+) bytes smem", rest)
    barriers = re.search(r"used (\d+) barriers", rest)
    lmem = re.search(r"(\d+) bytes lmem", rest)  # the linker's summary (a cached link: no ptxas lines)
    linker_stack = re.search(r"(\d+) stack\b", rest)
    spill_bytes = int(spills.group(1)) + int(spills.group(2)) if spills else int(lmem.group(1)) if lmem else None
    stack_bytes = int(stack.group(1)) if stack else int(linker_stack.group(1)) if linker_stack else None
    return {
        "registers": int(used.group(1)) if used else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "spill_bytes": spill_bytes,
        "stack_bytes": stack_bytes,
        "shared_bytes": (int(smem.group(1)) if smem else 0) if used else None,
        "barriers": (int(barriers.group(1)) if barriers else 0) if used else None,
        "function": entry.group(1) if entry else None,
        "log": log,
    }


class PtxasError(RuntimeError):
    """ptxas (through nvJitLink) refused the PTX, or its log could not be read; ``.log`` has its output."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


def compile_ltoir_offline(pyfunc, signature, cc=(9, 0), **options) -> bytes:
    """Compile a kernel's Python source to NVVM's link-time-optimisation IR, as numba-cuda does on a GPU.

    On a machine with nvJitLink, numba-cuda compiles every kernel this way and
    links it with link-time optimisation: ptxas then sees the whole program.
    That matters for what ptxas may do (``setmaxnreg`` is honoured only then),
    so :func:`ptxas_info_lto` of this is the faithful offline view of the GPU's
    kernel.  Needs no GPU; must be called without the simulator active.
    """
    if SIMULATOR:
        raise RuntimeError("compile_ltoir_offline needs the real numba-cuda, not the simulator")
    with _pretend_device(cc):
        code, _ = cuda.compile(pyfunc, signature, cc=cc, device=False, output="ltoir", abi="numba", **options)
    return bytes(code)


def compile_ptx_and_ltoir_offline(pyfunc, signature, cc=(9, 0), **options) -> tuple[str, bytes]:
    """Both :func:`compile_ptx_offline`'s PTX and :func:`compile_ltoir_offline`'s LTO IR, from one compile.

    Numba's part of a compile (typing and lowering the kernel and its inlined
    device functions to LLVM IR) is most of its time: about 90 % for a
    warp-specialised forward kernel on a two-core CPU like CI's, against a few seconds for
    each NVVM run.  Here it runs once, and NVVM twice over the same LLVM IR.
    This relies on numba-cuda's internal ``_compile_pyfunc_with_fixup`` (the
    step that :func:`numba.cuda.compile` runs before it asks the code library
    for PTX or LTO IR).  Where a numba-cuda release lacks that step, the two
    public compiles run instead, with the same results.
    """
    if SIMULATOR:
        raise RuntimeError("compile_ptx_and_ltoir_offline needs the real numba-cuda, not the simulator")
    from numba.core.compiler_lock import global_compiler_lock
    from numba.cuda import compiler

    fixup = getattr(compiler, "_compile_pyfunc_with_fixup", None)
    if fixup is None:
        return (compile_ptx_offline(pyfunc, signature, cc=cc, **options),
                compile_ltoir_offline(pyfunc, signature, cc=cc, **options))
    with global_compiler_lock, _pretend_device(cc):
        library, _ = fixup(pyfunc, signature, device=False, cc=cc, abi="numba", **options)
        # Without gen-lto in the library's options, get_asm_str compiles PTX; get_ltoir adds gen-lto itself.
        return library.get_asm_str(cc=cc), bytes(library.get_ltoir(cc=cc))


def ptxas_info(ptx: str, arch: str = "sm_90", *, check: bool = True) -> dict:
    """Assemble ``ptx`` for ``arch`` (``"sm_80"``, ``"sm_90"``, ``"sm_90a"``…) with ptxas, through nvJitLink.

    ``ptx`` is PTX text (assembled as code for linking, as PTX handed to a
    linker is) or the ``bytes`` of LTO IR from :func:`compile_ltoir_offline`
    (linked with link-time optimisation, as numba-cuda links on a GPU).

    Needs no GPU and no driver, only the ``cuda.bindings`` package (imported
    here, not at module load); without it this raises :class:`ImportError`, so
    a test calls ``pytest.importorskip("cuda.bindings.nvjitlink")`` first.

    Returns :func:`parse_ptxas_log`'s fields of the ``-verbose`` log, plus
    ``ok`` (ptxas accepted the PTX), ``error_log`` (nvJitLink's error log when
    it did not, else ``""``) and ``cubin`` (the linked cubin's bytes, or None).
    When ptxas refuses the PTX, ``check=True`` raises :class:`PtxasError`;
    ``check=False`` returns ``ok=False`` with the error log appended to ``log``
    and the other fields as far as the log has them.  A successful link whose
    log lacks the registers, spill or stack-frame line raises
    :class:`PtxasError` either way, so a changed log format cannot pass as None.
    """
    from cuda.bindings import nvjitlink

    lto = isinstance(ptx, bytes)  # LTO IR (compile_ltoir_offline): linked whole, ptxas' log asked for by -Xptxas
    # -no-cache: nvJitLink 13.0 keeps the results of LTO links in a cache and, for an input it has linked before
    # (in this process or an earlier one), skips ptxas and returns an empty log (the GPU image, 2026-12-06; 13.5
    # logs either way).  A version that does not know the option is asked without it.
    options = [f"-arch={arch}", "-verbose"] + (["-lto", "-Xptxas=-v"] if lto else [])
    try:
        handle = nvjitlink.create(len(options) + 1, [*options, "-no-cache"])
    except nvjitlink.nvJitLinkError:
        handle = nvjitlink.create(len(options), options)
    try:
        data = ptx if lto else ptx.encode()
        kind = nvjitlink.InputType.LTOIR if lto else nvjitlink.InputType.PTX
        try:  # ptxas runs in add_data (or in complete)
            nvjitlink.add_data(handle, kind, data, len(data), "kernel.ltoir" if lto else "kernel.ptx")
            nvjitlink.complete(handle)
            ok = True
        except nvjitlink.nvJitLinkError:
            ok = False
        buf = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, buf)
        log = buf.decode(errors="replace").rstrip("\0")
        error_log, cubin = "", None
        if ok:
            buf = bytearray(nvjitlink.get_linked_cubin_size(handle))
            nvjitlink.get_linked_cubin(handle, buf)
            cubin = bytes(buf)
        else:
            buf = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, buf)
            error_log = buf.decode(errors="replace").rstrip("\0")
    finally:
        nvjitlink.destroy(handle)
    if not ok:
        if check:
            raise PtxasError(f"ptxas refused the PTX for {arch}:\n{error_log[-4000:]}", log + error_log)
        log += error_log
    info = parse_ptxas_log(log)
    info.update(ok=ok, error_log=error_log, cubin=cubin, arch=arch)
    if ok:
        missing = [k for k in ("registers", "spill_bytes", "stack_bytes") if info[k] is None]
        if missing:
            raise PtxasError(f"no {', '.join(missing)} in ptxas' log for {arch}:\n{log[-4000:]}", log)
    return info
