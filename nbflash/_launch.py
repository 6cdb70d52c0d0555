"""The fast launch path: a Numba-compiled kernel launched with one driver call.

Numba's dispatcher re-types and re-marshals every argument on every launch
(70–220 µs for an attention launch).  Here that work is done once per kernel
and *argument signature*; a launch then only packs numbers into a buffer and
calls ``cuLaunchKernel`` (``cuda.bindings``), as CuPy's own launcher does.

1. **Describe the arguments.**  An array is four numbers and a dtype,
   :class:`ArrayArg` ``(ptr, shape, strides in bytes, dtype)`` — made from a
   CuPy array, a Numba device array, or by the caller (the PyTorch bridge
   describes ``torch.Tensor`` s itself: no DLPack, no
   ``__cuda_array_interface__``).  Scalars are Python ``float``/``bool``/``int``
   or NumPy scalars.  The *key* of a call is each argument's kind: an array's
   dtype, ndim and layout (``C`` contiguous, ``F`` or ``A`` any strides — the
   rule Numba's own typing follows), a scalar's type.
2. **Compile once per key** (:class:`Launcher`): the Numba signature is built
   from the key, ``dispatcher.compile(signature)`` compiles (or finds) the
   overload, the dynamic shared-memory limit is raised, and the compiled
   kernel's ``CUfunction`` in the device's context is taken, per device.
3. **Pack and launch.**  Numba's kernel ABI flattens each argument into
   parameters (``numba.cuda.dispatcher._Kernel._prepare_args``)::

       array (ndim n)   meminfo u64, parent u64, nitems i64, itemsize i64, data u64,
                        shape[n] i64, strides[n] i64 (bytes)          -- 5 + 2n params
       float64/float32  one f64 / f32        int<k>/uint<k>  one s<k>/u<k>
       boolean          one u8               float16         one b16 (the bits)
       complex          real, imag           tuple           its members, in order

   Each parameter sits at its natural alignment, which is exactly the layout
   of a native ``struct`` format (``"@QQqqQqqqq…d?…"``), so one
   ``Struct.pack_into`` writes the whole parameter buffer, and
   ``cuLaunchKernel`` takes it through ``extra``
   (``CU_LAUNCH_PARAM_BUFFER_POINTER``/``_SIZE``/``_END``) or through
   ``kernelParams`` (pointers into the same buffer) — :data:`PARAMS_VIA`.
   The buffer belongs to the launcher and a lock serialises pack-and-launch
   (the binding releases the GIL during the driver call); the driver copies
   the parameters before it returns, so nothing has to outlive the call.

4. **Replay whole calls** (:class:`Recipe`).  A public call records the
   launches it would make once per call signature, on placeholder pointers,
   and then only substitutes its own pointers and packs (see the section
   *Recipes* below): validation, kernel choice and argument description are
   paid once per signature, not once per call.

Launches go on the stream handle the caller gives (an ``int``: CuPy's or
PyTorch's current stream), so they are ordered with the caller's work and can
be captured into a CUDA graph.  A driver error raises :class:`LaunchError`.
Arguments this module cannot describe make :func:`launch` return ``False``,
and :func:`nbflash._device.launch` falls back to Numba's dispatcher.

GPU only: the simulator keeps Numba's own launch (``nbflash._device.launch``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import struct
import threading
from typing import NamedTuple

import numpy as np
from cuda.bindings import driver as _driver

from . import _device

#: How the packed parameters reach the driver: ``"extra"`` (one buffer) or ``"params"`` (``kernelParams``).
PARAMS_VIA = "extra"


class LaunchError(RuntimeError):
    """The CUDA driver refused a kernel launch."""


class ArrayArg(NamedTuple):
    """A GPU array as a kernel sees it: data pointer, shape, strides in bytes, dtype (NumPy).

    bfloat16 travels as ``uint16`` (the kernels take its bits).  No ownership:
    the caller keeps the memory alive until the kernel has run (stream order).
    """

    ptr: int
    shape: tuple
    strides: tuple
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def permute(self, axes) -> ArrayArg:
        """The same memory with its axes reordered (``transpose``): no copy, no launch."""
        return ArrayArg(self.ptr, tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes), self.dtype)

    transpose = permute


class Derived(NamedTuple):
    """An argument made at launch time from the call's arrays: ``make(sources, stream, device)`` returns the
    device array to pass (CuPy), whose shape, strides and dtype are those of ``like``.

    For arguments that hold the addresses of others — a TMA tensor map names
    its array's address (:mod:`nbflash.tma`) — and so cannot be made once
    for a recording on placeholder pointers.  A direct launch
    (:func:`nbflash._device.launch`) makes it just before launching; a
    :class:`Recipe` makes it at every replay from that replay's pointers
    (``make`` caches what it made: a replay of the same pointers finds it).
    """

    make: object
    sources: tuple  # ArrayArgs
    like: ArrayArg


def describe_cupy(a) -> ArrayArg:
    return ArrayArg(a.data.ptr, a.shape, a.strides, a.dtype)


def describe_numba(a) -> ArrayArg:
    return ArrayArg(a.device_ctypes_pointer.value or 0, a.shape, a.strides, a.dtype)


#: type -> function giving its ArrayArg; filled lazily (cupy.ndarray, Numba's DeviceNDArray).
_DESCRIBE: dict = {ArrayArg: lambda a: a}

#: Python and NumPy scalar types -> struct code (what Numba's typeof makes of them).
_SCALARS = {
    float: "d",
    bool: "?",
    int: "q",
    np.float64: "d",
    np.float32: "f",
    np.float16: "e",
    np.bool_: "?",
    np.int8: "b",
    np.int16: "h",
    np.int32: "i",
    np.int64: "q",
    np.uint8: "B",
    np.uint16: "H",
    np.uint32: "I",
    np.uint64: "Q",
}


def _describer(t):
    """How to describe an argument of type ``t`` as an array, or None (then Numba's dispatcher launches)."""
    if t in _DESCRIBE:
        return _DESCRIBE[t]
    fn = None
    mod = t.__module__.split(".")[0]
    if mod == "cupy" and t.__name__ == "ndarray":
        fn = describe_cupy
    elif mod == "numba" and hasattr(t, "device_ctypes_pointer") and hasattr(t, "strides"):
        fn = describe_numba
    _DESCRIBE[t] = fn
    return fn


def describe(a) -> ArrayArg:
    """The :class:`ArrayArg` of a CuPy array, a Numba device array or an ArrayArg."""
    fn = _describer(type(a))
    if fn is None:
        raise TypeError(f"expected a GPU array (CuPy, Numba) or an ArrayArg, got {type(a).__name__}")
    return fn(a)


_LAYOUTS: dict = {}


def array_layout(shape, strides, itemsize: int) -> str:
    """Numba's layout letter for these strides: ``"C"``, ``"F"`` or ``"A"`` (memoised).

    NumPy's contiguity rule (axes of length 1 may have any stride), which is
    the rule under which a ``C``/``F`` kernel — it computes addresses from the
    shape alone — reads the same elements as the strides say.  Broadcast
    (zero-stride) axes of length > 1 are never contiguous.
    """
    key = (shape, strides, itemsize)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = "A"
        if math.prod(shape) == 0:
            layout = "C"
        else:
            for order in ("C", "F"):
                expected = itemsize
                ok = True
                for n, s in zip(
                    reversed(shape) if order == "C" else shape,
                    reversed(strides) if order == "C" else strides,
                    strict=True,
                ):
                    if n != 1:
                        if s != expected:
                            ok = False
                            break
                        expected *= n
                if ok:
                    layout = order
                    break
        if len(_LAYOUTS) > 4096:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


# ----------------------------------------------------------------------------
# The parameter ABI, from Numba types
# ----------------------------------------------------------------------------


def param_codes(argtypes) -> list[str]:
    """The ``struct`` code of every kernel parameter, in order, for Numba argument types ``argtypes``.

    Mirrors ``numba.cuda.dispatcher._Kernel._prepare_args`` (numba-cuda 0.30):
    one code per PTX ``.param`` of the kernel's entry.  Raises
    ``NotImplementedError`` for a type it does not know (records, enums, ...).
    """
    types = _device.numba_types()
    codes: list[str] = []
    ints = {
        types.int8: "b",
        types.int16: "h",
        types.int32: "i",
        types.int64: "q",
        types.uint8: "B",
        types.uint16: "H",
        types.uint32: "I",
        types.uint64: "Q",
    }
    for ty in argtypes:
        if isinstance(ty, types.Array):
            codes += ["Q", "Q", "q", "q", "Q"] + ["q"] * (2 * ty.ndim)
        elif isinstance(ty, types.CPointer):
            codes.append("Q")
        elif ty in ints:
            codes.append(ints[ty])
        elif ty == types.float16:
            codes.append("e")
        elif ty == types.float32:
            codes.append("f")
        elif ty == types.float64:
            codes.append("d")
        elif ty == types.boolean:
            codes.append("?")
        elif ty == types.complex64:
            codes += ["f", "f"]
        elif ty == types.complex128:
            codes += ["d", "d"]
        elif isinstance(ty, types.BaseTuple):
            codes += param_codes(list(ty))
        else:
            raise NotImplementedError(f"the fast launch path cannot pass a {ty} argument")
    return codes


def param_offsets(codes) -> list[int]:
    """Byte offset of each parameter in the packed buffer (natural alignment, as the driver expects)."""
    offsets = []
    for i, c in enumerate(codes):
        end = struct.calcsize("@" + "".join(codes[: i + 1]))
        offsets.append(end - struct.calcsize(c))
    return offsets


def _signature(key) -> tuple:
    """The Numba argument types for a call key (see :func:`_flatten`)."""
    sig = []
    for k in key:
        if isinstance(k, tuple):
            dtype, ndim, layout = k
            sig.append(_device.array_type(np.dtype(dtype), ndim, layout))
        else:
            sig.append(_device.scalar_type(k))
    return tuple(sig)


_ARRAYS: dict = {}


def _array_kind(shape, strides, dtype):
    """``(key part, nitems, itemsize, dtype)`` of an array, memoised by shape, strides and dtype.

    The key part ``(dtype.str, ndim, layout)`` hashes fast (a NumPy dtype does
    not cache its hash); the memo is keyed by the dtype's ``id``, which stays
    unique while the entry holds the dtype.
    """
    itemsize = dtype.itemsize
    kind = ((dtype.str, len(shape), array_layout(shape, strides, itemsize)), math.prod(shape), itemsize, dtype)
    if len(_ARRAYS) > 4096:
        _ARRAYS.clear()
    _ARRAYS[shape, strides, id(dtype)] = kind
    return kind


def _flatten(args):
    """``(key, values)``: each argument's kind, and every parameter value in ABI order; None if unsupported."""
    key = []
    values = []
    for a in args:
        t = type(a)
        if t is ArrayArg:
            ptr, shape, strides, dtype = a
        else:
            code = _SCALARS.get(t)
            if code is not None:
                key.append(code)
                values.append(a)
                continue
            describe = _DESCRIBE.get(t, False)
            if describe is False:
                describe = _describer(t)
            if describe is None:
                return None, None
            ptr, shape, strides, dtype = describe(a)
        kind = _ARRAYS.get((shape, strides, id(dtype)))
        if kind is None:
            kind = _array_kind(shape, strides, dtype)
        key.append(kind[0])
        values += (0, 0, kind[1], kind[2], ptr, *shape, *strides)
    return tuple(key), values


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _dim3(d) -> tuple[int, int, int]:
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


class Launcher:
    """One compiled kernel overload, ready to launch: a packed-parameter buffer and its driver handles."""

    def __init__(self, dispatcher, argtypes):
        self.dispatcher = dispatcher
        self.argtypes = tuple(argtypes)
        self.codes = param_codes(self.argtypes)
        self.struct = struct.Struct("@" + "".join(self.codes))
        self.size = self.struct.size
        self.buffer = ctypes.create_string_buffer(max(self.size, 8))
        base = ctypes.addressof(self.buffer)
        self._size_t = ctypes.c_size_t(self.size)
        self._extra = (ctypes.c_void_p * 5)(
            _driver.CU_LAUNCH_PARAM_BUFFER_POINTER,
            base,
            _driver.CU_LAUNCH_PARAM_BUFFER_SIZE,
            ctypes.addressof(self._size_t),
            _driver.CU_LAUNCH_PARAM_END,
        )
        self._params = (ctypes.c_void_p * max(len(self.codes), 1))(*(base + o for o in param_offsets(self.codes)))
        self.lock = threading.Lock()
        self.devices: dict[int, tuple] = {}  # device id -> (CUfunction, dynamic shared-memory limit)

    def _prepare(self, device: int, shared_bytes: int):
        """Compile (once), load on ``device`` and raise its dynamic shared-memory limit to ``shared_bytes``."""
        func, limit = self.devices.get(device, (None, 0))
        if func is None or shared_bytes > limit:
            handle = _device.kernel_handle(self.dispatcher, self.argtypes, device, max(limit, shared_bytes))
            # The context's own CUfunction of the CUkernel, so the driver need not look it up on every launch.
            err, func = _driver.cuKernelGetFunction(_driver.CUkernel(handle))
            if err:  # pragma: no cover - a CUkernel also launches as a CUfunction (the driver allows it)
                func = _driver.CUfunction(handle)
            self.devices[device] = (func, max(limit, shared_bytes))
        return func

    def __call__(self, grid, block, stream: int, shared_bytes: int, values, device: int | None = None) -> None:
        """Launch on the stream handle ``stream`` with ``values`` (see :func:`_flatten`) as the parameters."""
        if device is None:
            device = current_device()
        entry = self.devices.get(device)
        func = entry[0] if entry is not None and shared_bytes <= entry[1] else self._prepare(device, shared_bytes)
        gx, gy, gz = grid if type(grid) is tuple and len(grid) == 3 else _dim3(grid)
        bx, by, bz = block if type(block) is tuple and len(block) == 3 else _dim3(block)
        if PARAMS_VIA == "extra":
            params, extra = 0, ctypes.addressof(self._extra)
        else:
            params, extra = ctypes.addressof(self._params), 0
        with self.lock:
            self.struct.pack_into(self.buffer, 0, *values)
            (err,) = _driver.cuLaunchKernel(
                func, gx, gy, gz, bx, by, bz, shared_bytes, _cu_stream(stream), params, extra
            )
        if err:
            raise LaunchError(
                f"cuLaunchKernel failed for {getattr(self.dispatcher, '__name__', self.dispatcher)} "
                f"(grid {grid}, block {block}, {shared_bytes} bytes of dynamic shared memory, stream {stream:#x}): "
                f"{error_string(err)}"
            )


def error_string(err) -> str:
    """``CUDA_ERROR_…: description`` for a driver result code."""
    try:
        _, text = _driver.cuGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # pragma: no cover - an unknown code
        text = "unknown error"
    name = getattr(err, "name", str(err))
    return f"{name}: {text}"


def current_device() -> int:
    """The id of the device whose context is current on this thread (made current by Numba if none is)."""
    err, dev = _driver.cuCtxGetDevice()
    if err:
        _device.ensure_context()
        err, dev = _driver.cuCtxGetDevice()
        if err:
            raise LaunchError(f"no CUDA context is current: {error_string(err)}")
    return int(dev)


_STREAMS: dict = {}


def _cu_stream(handle: int):
    """A cached ``CUstream`` object for a raw handle (the binding would build one per call)."""
    s = _STREAMS.get(handle)
    if s is None:
        if len(_STREAMS) > 256:
            _STREAMS.clear()
        s = _STREAMS[handle] = _driver.CUstream(handle)
    return s


_LAUNCHERS: dict = {}
_LAUNCHERS_LOCK = threading.Lock()


def launcher(dispatcher, key) -> Launcher | None:
    """The cached :class:`Launcher` of ``dispatcher`` for a call key; None if the fast path cannot pass it."""
    try:
        return _LAUNCHERS[(dispatcher, key)]
    except KeyError:
        pass
    with _LAUNCHERS_LOCK:
        if (dispatcher, key) not in _LAUNCHERS:
            try:
                _LAUNCHERS[(dispatcher, key)] = Launcher(dispatcher, _signature(key))
            except NotImplementedError:
                _LAUNCHERS[(dispatcher, key)] = None
        return _LAUNCHERS[(dispatcher, key)]


def launch(dispatcher, grid, block, stream: int, shared_bytes: int, args, device: int | None = None) -> bool:
    """Launch ``dispatcher`` on ``args`` through the fast path; False (nothing launched) if it cannot pass them.

    ``stream``: a raw ``CUstream`` handle (0: the legacy default stream).
    ``device``: the current device's id, if the caller knows it (saves a driver query).
    """
    key, values = _flatten(args)
    if key is None:
        return False
    run = launcher(dispatcher, key)
    if run is None:
        return False
    try:
        run(grid, block, stream, shared_bytes, values, device)
    except NotImplementedError:  # a debug/cooperative kernel, found when first loaded: Numba launches it
        with _LAUNCHERS_LOCK:
            _LAUNCHERS[(dispatcher, key)] = None
        return False
    return True


# ----------------------------------------------------------------------------
# Recipes: the launches of one call signature, recorded once, replayed per call
# ----------------------------------------------------------------------------
#
# A public call (``nbflash.attention`` and friends) validates its inputs,
# chooses kernels, allocates scratch and then launches one to four kernels.
# For a given *signature* — the inputs' types, shapes, strides, dtypes and
# device, the flags, and which data pointers are 16-byte aligned — all
# of that comes out the same every time; only the data pointers change.  So the
# first call of a signature runs the launch functions in recording mode, with
# placeholder pointers, and keeps what they would launch as a :class:`Recipe`;
# every call of that signature (the first included) replays the recipe with
# its real pointers: a list copy, a few integer stores, ``pack_into`` and
# ``cuLaunchKernel`` per kernel.

#: Placeholder pointers: ``(slot + 1) << PLACEHOLDER_SHIFT`` plus a byte offset.  Far above any real address
#: (device pointers live below 2**57 on every current platform, and offsets stay below 2**52).
PLACEHOLDER_SHIFT = 52
_OFFSET_MASK = (1 << PLACEHOLDER_SHIFT) - 1


def placeholder(slot: int) -> int:
    """The placeholder pointer that stands for the ``slot``-th pointer of a recorded call."""
    return (slot + 1) << PLACEHOLDER_SHIFT


class _Recording(threading.local):
    launches: list | None = None


_recording = _Recording()


def recording() -> list | None:
    """The list launches are being recorded into on this thread, or None (then they run)."""
    return _recording.launches


@contextlib.contextmanager
def record():
    """Within the block, :func:`nbflash._device.launch` appends ``(dispatcher, grid, block, shared_bytes, args)``
    to the yielded list instead of launching."""
    saved = _recording.launches
    _recording.launches = launches = []
    try:
        yield launches
    finally:
        _recording.launches = saved


class Arena:
    """The scratch allocator of a recorded call: ``empty(shape, dtype)`` carves C-contiguous pieces out of one
    placeholder buffer (slot ``slot``), 256-byte aligned, so a replay allocates all scratch at once."""

    ALIGN = 256

    def __init__(self, slot: int):
        self.base = placeholder(slot)
        self.nbytes = 0

    def __call__(self, shape, dtype) -> ArrayArg:
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in shape)
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        arg = ArrayArg(self.base + self.nbytes, shape, tuple(reversed(strides)), dtype)
        self.nbytes += -(-step // self.ALIGN) * self.ALIGN
        return arg


class Recipe:
    """Recorded launches, replayable with real pointers: ``recipe(ptrs, stream, device)``.

    ``ptrs[i]`` replaces placeholder slot ``i`` (plus each use's recorded byte
    offset).  A :class:`Derived` argument is made again at every replay, from
    its sources at the replay's pointers.  ``scratch_bytes``: the size of the
    arena the caller allocates and passes as the last pointer (0: none).
    Raises ``NotImplementedError`` at construction if a launch has arguments
    the fast path cannot pass.
    """

    __slots__ = ("steps", "scratch_bytes")

    def __init__(self, launches, scratch_bytes: int = 0):
        steps = []
        for dispatcher, grid, block, shared_bytes, args in launches:
            # A Derived argument is recorded as its data pointer's parameter index and how to make it.
            derived, marked = [], list(args)
            for j, a in enumerate(args):
                if type(a) is Derived:
                    marker = placeholder(_DERIVED_SLOT + len(derived))
                    derived.append((marker, a.make, tuple(_source(s) for s in a.sources)))
                    marked[j] = a.like._replace(ptr=marker)
            key, values = _flatten(marked)
            run = None if key is None else launcher(dispatcher, key)
            if run is None:
                raise NotImplementedError(f"arguments of {dispatcher} the fast launch cannot pass")
            slots = tuple(
                (i, (v >> PLACEHOLDER_SHIFT) - 1, v & _OFFSET_MASK)
                for i, v in enumerate(values)
                if type(v) is int and 1 <= v >> PLACEHOLDER_SHIFT <= _DERIVED_SLOT
            )
            made = tuple((values.index(marker), make, sources) for marker, make, sources in derived)
            steps.append((run, _dim3(grid), _dim3(block), int(shared_bytes), values, slots, made))
        self.steps = tuple(steps)
        self.scratch_bytes = int(scratch_bytes)

    @staticmethod
    def _make(vals, made, ptrs, stream: int, device: int) -> None:
        """Fill in the Derived arguments of one launch: each made from its sources at this replay's pointers."""
        for i, make, sources in made:
            arrays = tuple(ArrayArg(offset if slot < 0 else ptrs[slot] + offset, *rest)
                           for slot, offset, *rest in sources)
            vals[i] = make(arrays, stream, device).data.ptr

    def values(self, ptrs, stream: int = 0, device: int = 0) -> list[list]:
        """Each launch's parameter values with ``ptrs`` in place of the placeholders (what a replay packs)."""
        out = []
        for _, _, _, _, values, slots, made in self.steps:
            vals = values.copy()
            for i, slot, offset in slots:
                vals[i] = ptrs[slot] + offset
            if made:
                self._make(vals, made, ptrs, stream, device)
            out.append(vals)
        return out

    def __call__(self, ptrs, stream: int, device: int) -> None:
        for run, grid, block, shared_bytes, values, slots, made in self.steps:
            vals = values.copy()
            for i, slot, offset in slots:
                vals[i] = ptrs[slot] + offset
            if made:
                self._make(vals, made, ptrs, stream, device)
            run(grid, block, stream, shared_bytes, vals, device)


#: The placeholder slots that mark Derived arguments' pointers in a recording (far above any call's arrays).
_DERIVED_SLOT = 1 << 10


def _source(a: ArrayArg) -> tuple:
    """``(slot, offset, shape, strides, dtype)`` of a Derived argument's source: slot -1 for a real pointer."""
    if a.ptr >> PLACEHOLDER_SHIFT:
        return ((a.ptr >> PLACEHOLDER_SHIFT) - 1, a.ptr & _OFFSET_MASK, a.shape, a.strides, a.dtype)
    return (-1, a.ptr, a.shape, a.strides, a.dtype)


def recorded(fn, *args, slots: int, **kwargs) -> Recipe:
    """The :class:`Recipe` of ``fn(*args, empty=arena, **kwargs)``: its launches recorded, scratch from an
    :class:`Arena` at placeholder slot ``slots`` (the arguments' own placeholders use slots ``0..slots-1``)."""
    arena = Arena(slots)
    with record() as launches:
        fn(*args, empty=arena, **kwargs)
    return Recipe(launches, arena.nbytes)


def placeholder_args(arrays) -> list[ArrayArg]:
    """Descriptors of ``arrays`` (ArrayArgs or CuPy arrays) with placeholder pointers ``0, 1, ...``."""
    out = []
    for i, a in enumerate(arrays):
        if type(a) is not ArrayArg:
            a = _describer(type(a))(a)
        out.append(ArrayArg(placeholder(i), tuple(a.shape), tuple(a.strides), np.dtype(a.dtype)))
    return out


def signature_key(device: int, meta, aligned, flags):
    """The key of a call signature: the device, each array's ``(shape, strides, dtype)``, which data pointers
    are 16-byte aligned (``aligned``: one bool per array — a kernel choice may hang on any one of them, e.g.
    cp.async on q, k, v but not on lse), and the flags; None if a flag is unhashable."""
    key = (device, tuple(meta), tuple(aligned), *flags)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class SignatureCache(dict):
    """Recipes (or anything) by call signature, cleared when it grows past ``limit`` entries."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


__all__ = [
    "PARAMS_VIA",
    "Arena",
    "ArrayArg",
    "Derived",
    "LaunchError",
    "Launcher",
    "Recipe",
    "SignatureCache",
    "array_layout",
    "describe",
    "describe_cupy",
    "launch",
    "launcher",
    "param_codes",
    "param_offsets",
    "placeholder",
    "placeholder_args",
    "record",
    "recorded",
    "signature_key",
]
