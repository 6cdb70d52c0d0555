"""Hopper's tensor memory accelerator (TMA) and the mbarriers that count its bytes, from Python.

``cp.async`` (:mod:`nbflash.intrinsics`) copies 16 bytes per thread and
instruction: a 128 × 128 half-precision tile is 2048 instructions, each with
its own address arithmetic, spread over the threads that issue them.  The TMA
unit copies a whole *box* of a tensor with **one** instruction issued by **one**
thread: the shape, strides and bounds of the tensor live in a 128-byte
*tensor map* made once on the host; the kernel names only the box's
coordinates.  Rows past the end of the tensor arrive as zeros (a ragged tail
costs nothing), and the box lands in shared memory already in the 128-byte
swizzled layout that ``wgmma`` descriptors read (:mod:`nbflash.hopper`).

Completion is counted in bytes by an **mbarrier**, a 64-bit object in shared
memory with a *phase*:

* :func:`mbarrier_init` sets the number of arrivals a phase waits for;
* :func:`mbarrier_arrive_expect_tx` is one arrival that also announces how
  many bytes are coming; each TMA copy names the barrier and, as its bytes
  land, lowers that count (``complete_tx``);
* the phase completes when every arrival came and every announced byte
  landed; its parity (0, 1, 0, …) flips, and :func:`mbarrier_try_wait_parity`
  (``parity`` = the parity of the phase waited for) starts returning True.

One stage of a pipeline, per tile::

    thread 0:     arrive_expect_tx(bar, bytes) ; tma_load_4d(smem, ..., bar)   # issue and go on
    every thread: while not try_wait_parity(bar, phase): pass                   # the tile is in smem
                  ... read the tile (ldmatrix, wgmma) ...;  phase ^= 1 on the next use of bar

Unlike ``cp.async``, nothing is waited per thread and no barrier over the
block is needed to publish the tile: the mbarrier *is* the hand-over, and the
bytes are written through the async proxy, so a ``wgmma`` may read them
without a proxy fence.

The tensor map (:func:`make_tensor_map`)
========================================

Made with the driver's ``cuTensorMapEncodeTiled`` (through ``cuda.bindings``)
for a 4-D ``(batch, heads, rows, D)`` array of 16-bit elements whose last axis
is contiguous (both of nbflash's layouts: ``bshd`` is a strided view), as the
TMA sees it, innermost first::

    dims     (D, rows, heads, batch)          element strides 1, 1, 1, 1
    strides  (row, head, batch) in bytes      each a multiple of 16
    box      (box_cols, box_rows, 1, 1)       box_cols · 2 = 128 bytes with the 128-byte swizzle

The copy of box ``(c0, c1, c2, c3)`` = (first column, first row, head, batch)
writes ``box_rows`` rows of ``box_cols · 2`` bytes; with
:data:`SWIZZLE_128B` the 16-byte chunk c of row r lands at chunk
``c ^ (r % 8)`` — :func:`nbflash.hopper.kmajor_sw128_offset`'s layout, so a
D = 64 tile is one box and a D = 128 tile is two (columns 0..63 and 64..127,
each its own 64-column panel).  Elements outside the tensor are zero; the
transaction count is the whole box, in bounds or not.

The map is passed to a kernel as a 128-byte ``uint8`` device array (a
``.global`` tensor map: the PTX ISA allows ``.param``, ``.const`` or
``.global``; Numba cannot declare a ``__grid_constant__`` parameter, and a map
written before the launch needs no proxy fence).  :func:`stacked_maps` keeps
each set of maps by address in device memory (:class:`_MapStore`), so a
call on arrays seen before encodes and copies nothing.

The simulator
=============

The map's first 8 bytes are a key into a table of the host-side description
(array, box, swizzle); :func:`tma_load_4d` reads the box at issue time
(zeros outside the tensor) and writes it, in the swizzled layout, when the
barrier's phase completes — as late as the hardware may.  The mbarrier is a counter per block and address with
the hardware's rules (arrivals, announced bytes, phase parity); a wait on a
barrier nobody initialised is an error.

PTX: ``mbarrier.init``, ``mbarrier.arrive.expect_tx``, ``mbarrier.arrive``,
``mbarrier.try_wait.parity`` (the PTX ISA's mbarrier section), ``fence.mbarrier_init``,
``cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes``
(its bulk-copy section); sm_90.  The tensor map: CUDA driver API
``cuTensorMapEncodeTiled``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import types

from ._device import SIMULATOR, _sim_lock, intrinsic
from .hopper import (
    SWIZZLE_128B,
    SWIZZLE_NONE,
    _make_gpu_statement,
    _sim_block_fenced,
    _sim_block_state,
    _sim_smem_address,
    kmajor_sw128_offset,
)
from .intrinsics import _I32, _I64, _asm, _global_address, _is_flat_array, _is_int, _public, _shared_address

__all__ = [
    "TensorMap",
    "fence_mbarrier_init",
    "launch_maps",
    "make_tensor_map",
    "mbarrier_arrive",
    "mbarrier_arrive_expect_tx",
    "mbarrier_init",
    "mbarrier_try_wait_parity",
    "stacked_maps",
    "stride_problem",
    "tma_load_4d",
]

TENSOR_MAP_BYTES = 128


# ----------------------------------------------------------------------------
# The tensor map (host)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map of a 4-D array: ``map`` (128 bytes, a device array) goes to the kernel.

    ``source`` keeps the described array alive as long as the map.
    """

    map: object
    source: object
    box_rows: int
    box_cols: int
    swizzle: int

    @property
    def box_bytes(self) -> int:
        """Bytes one :func:`tma_load_4d` of this map brings (its transaction count)."""
        return self.box_rows * self.box_cols * 2


def stride_problem(name: str, x) -> str:
    """Why the TMA cannot step along ``x``'s outer axes, or "": each stride (but that of an axis of length 1,
    never stepped along) must be a positive multiple of 16 bytes."""
    if any((s % 16 or s <= 0) and n > 1 for s, n in zip(x.strides[:3], x.shape[:3], strict=True)):
        return f"{name}'s strides must be positive multiples of 16 bytes for TMA, got {x.strides}"
    return ""


_SIM_MAPS: dict[int, TensorMap] = {}
_SIM_KEYS = itertools.count(1)


def make_tensor_map(x, box_rows: int, box_cols: int, swizzle: int = SWIZZLE_128B) -> TensorMap:
    """The tensor map of ``x`` (``(batch, heads, rows, D)``, 16-bit elements) for boxes of box_rows × box_cols.

    ``swizzle``: :data:`~nbflash.hopper.SWIZZLE_128B` (then ``box_cols`` must
    be 64: one 128-byte swizzled row per box row) or
    :data:`~nbflash.hopper.SWIZZLE_NONE` (rows of ``box_cols`` elements,
    a multiple of 8, stored densely).  ``x``'s last axis must be contiguous,
    its other strides multiples of 16 bytes (but those of axes of length 1),
    its start 16-byte aligned; a CuPy array on the GPU, a NumPy array in the
    simulator.
    """
    _check(x, box_rows, box_cols, swizzle)
    if SIMULATOR:
        tmap = np.zeros(TENSOR_MAP_BYTES, np.uint8)
        with _sim_lock:
            key = next(_SIM_KEYS)
        tmap[:8] = np.frombuffer(np.uint64(key).tobytes(), np.uint8)
        result = TensorMap(tmap, x, box_rows, box_cols, swizzle)
        _SIM_MAPS[key] = result
        return result
    import cupy as cp

    return TensorMap(cp.asarray(_encode(x.data.ptr, x, box_rows, box_cols, swizzle)), x, box_rows, box_cols,
                     swizzle)


def _check(x, box_rows: int, box_cols: int, swizzle: int) -> None:
    """Raise ValueError naming what :func:`make_tensor_map` cannot describe."""
    if x.ndim != 4 or x.dtype.itemsize != 2:
        raise ValueError(f"x must be a 4-D array of 16-bit elements, got shape {x.shape} of {x.dtype}")
    if any(s == 0 for s in x.shape):
        raise ValueError(f"x must not be empty, got shape {x.shape}")
    if x.strides[3] != 2:
        raise ValueError(f"x's last axis must be contiguous (stride 2 bytes), got strides {x.strides}")
    why = stride_problem("x", x)
    if why:
        raise ValueError(why)
    if swizzle == SWIZZLE_128B:
        if box_cols != 64:
            raise ValueError(f"with the 128-byte swizzle a box row is 64 elements, got box_cols={box_cols}")
    elif swizzle == SWIZZLE_NONE:
        if box_cols % 8 or not 0 < box_cols <= 256:
            raise ValueError(f"box_cols must be a multiple of 8 up to 256, got {box_cols}")
    else:
        raise ValueError(f"swizzle must be SWIZZLE_128B or SWIZZLE_NONE, got {swizzle!r}")
    if not 0 < box_rows <= 256:
        raise ValueError(f"box_rows must be 1..256, got {box_rows}")


def _encode(address: int, x, box_rows: int, box_cols: int, swizzle: int) -> np.ndarray:
    """The 128 bytes of the GPU tensor map of the array at ``address`` with ``x``'s shape and strides (checked
    by :func:`_check`), made on the host."""
    from cuda.bindings import driver

    if address % 16:
        raise ValueError(f"x must start 16-byte aligned, got address {address:#x}")

    batch, heads, rows, d = x.shape
    # An axis of one element is never stepped along: its stride, if not a positive multiple of 16 (the TMA's
    # rule), may be replaced by one that is, the extent of the axes inside it.
    strides, inner = [], 2 * d  # inner: bytes spanned by the axes inside the current one
    for i in (2, 1, 0):
        stride = x.strides[i]
        if x.shape[i] == 1 and (stride % 16 or stride <= 0):
            stride = -(-inner // 16) * 16
        strides.append(stride)
        inner = stride * x.shape[i]
    err, encoded = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,  # raw 16-bit words: f16 and bf16 alike
        4,
        address,
        [driver.cuuint64_t(n) for n in (d, rows, heads, batch)],  # innermost first
        [driver.cuuint64_t(n) for n in strides],  # bytes, dims 1..3
        [driver.cuuint32_t(n) for n in (box_cols, box_rows, 1, 1)],
        [driver.cuuint32_t(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle == SWIZZLE_128B
        else driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,  # zeros outside the tensor
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused the map of shape {x.shape}, strides {x.strides}, "
                         f"box {box_rows}×{box_cols}: {err}")
    return np.array([int(w) for w in encoded.opaque], np.uint64).view(np.uint8)


def _address(x) -> int:
    """The data pointer of a CuPy array or of a descriptor (:class:`nbflash._launch.ArrayArg`)."""
    data = getattr(x, "data", None)
    return int(data.ptr) if data is not None and hasattr(data, "ptr") else int(x.ptr)


def stacked_maps(specs, box_cols: int = 64, swizzle: int = SWIZZLE_128B, stream: int = 0,
                 device: int | None = None):
    """The tensor maps of ``specs`` as one ``(len(specs), 128)`` uint8 device array.

    Each spec is ``(array, box_rows)`` (boxes of ``box_cols`` columns with
    ``swizzle``) or ``(array, box_rows, its_box_cols, its_swizzle)``.
    ``array``: a CuPy array or an :class:`~nbflash._launch.ArrayArg` descriptor
    (a NumPy array in the simulator).  On the GPU the maps are cached by each
    array's address, shape and strides (a map describes exactly those, not the
    data: a training loop's repeated calls encode nothing).  The maps are in
    ``device``'s memory (default: the current device) before the kernel that
    reads them is launched on ``stream`` (a raw handle), also when that launch
    is being captured into a CUDA graph (:class:`_MapStore`).
    """
    boxes = [(x, rows, *(rest or (box_cols, swizzle))) for x, rows, *rest in specs]
    if SIMULATOR:
        return np.stack([make_tensor_map(*box).map for box in boxes])
    import cupy as cp

    if device is None:
        device = cp.cuda.runtime.getDevice()
    key = tuple((_address(x), x.shape, x.strides, x.dtype.itemsize, *box) for x, *box in boxes)
    store = _MapStore.of(device)
    maps = store.get(key, stream)
    if maps is None:
        for box in boxes:
            _check(*box)
        maps = store.put(key, np.stack([_encode(_address(x), x, *box) for x, *box in boxes]), stream)
    return maps


def launch_maps(arrays, boxes):
    """A kernel's ``maps`` argument: the tensor maps of ``arrays``, array i with boxes of ``boxes[i]`` =
    ``(box_rows, box_cols, swizzle)``.

    In the simulator, the maps themselves.  On the GPU a map holds its
    array's address, so this is a :class:`nbflash._launch.Derived` argument:
    made for each launch's own pointers and stream when it launches — at every
    replay of a recorded call (:func:`stacked_maps` caches them by address).
    """
    boxes = tuple(tuple(box) for box in boxes)
    if SIMULATOR:
        return stacked_maps([(x, *box) for x, box in zip(arrays, boxes, strict=True)])
    from . import _launch

    like = _launch.ArrayArg(0, (len(boxes), TENSOR_MAP_BYTES), (TENSOR_MAP_BYTES, 1), np.dtype(np.uint8))
    return _launch.Derived(_maps_maker(boxes), tuple(map(_launch.describe, arrays)), like)


@functools.cache
def _maps_maker(boxes):
    """``make(sources, stream, device)``: the tensor maps of ``sources`` with ``boxes`` (:func:`launch_maps`)."""

    def make(sources, stream: int, device: int):
        return stacked_maps([(x, *box) for x, box in zip(sources, boxes, strict=True)], stream=stream, device=device)

    return make


class _MapStore:
    """The tensor maps of one device: each set encoded once, on the host, and kept in device memory for good.

    Maps live in *slabs*: one ``cudaMalloc`` of device memory and a pinned host
    twin.  A new set is written into the host twin and copied into its device
    piece on a private stream, which the host then waits for (a 384-byte copy
    behind no other work): the maps are in place before any kernel that reads
    them is launched, on whatever stream.  Inside a CUDA graph capture nothing
    may wait: the copy goes on the capturing stream instead, a node of the
    graph ahead of the kernel (from pinned memory that never changes), and the
    set counts as written only once a later call outside a capture copies it
    again.  The next slab is allocated ahead, outside captures (no
    ``cudaMalloc`` while capturing).  Pieces are never reused while their
    slabs exist; past :attr:`LIMIT` sets the store waits for the device, frees
    every slab and starts again (a graph captured before then must be
    captured anew).
    """

    SLAB_BYTES = 1 << 17  # 1024 maps
    AHEAD_BYTES = 1 << 13  # the next slab is allocated once less than this is left
    LIMIT = 1 << 14  # sets kept before the store starts again
    _stores: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: int):
        self.device = device
        self.sets: dict = {}  # key -> [device array, host bytes (pinned), written outside a capture]
        self.slabs: list = []  # (device pointer, pinned host memory, its NumPy view), the last one in use
        self.used = 0  # bytes used of the last slab
        self.stream = None  # the private copy stream (CuPy, non-blocking)

    @classmethod
    def of(cls, device: int) -> _MapStore:
        store = cls._stores.get(device)
        if store is None:
            with cls._lock:
                store = cls._stores.setdefault(device, cls(device))
        return store

    def get(self, key, stream: int):
        """The device array of the set ``key``, in place for a kernel launched next on ``stream``; None if there
        is none yet."""
        entry = self.sets.get(key)
        if entry is None:
            return None
        if not entry[2]:  # so far only copied inside graph captures
            self._copy(entry, stream)
        return entry[0]

    def put(self, key, maps: np.ndarray, stream: int):
        """Store the host bytes ``maps`` (``(n, 128)`` uint8) under ``key``: the device array, in place for a
        kernel launched next on ``stream``."""
        import cupy as cp

        nbytes = maps.nbytes
        with self._lock, cp.cuda.Device(self.device):
            capturing = cp.cuda.runtime.streamIsCapturing(stream)
            if len(self.sets) >= self.LIMIT and not capturing:
                cp.cuda.runtime.deviceSynchronize()  # no kernel may still read a map freed here
                for pointer, _, _ in self.slabs:
                    cp.cuda.runtime.free(pointer)
                self.sets.clear()
                self.slabs.clear()
            if not self.slabs or self.used + nbytes > self.SLAB_BYTES:
                if capturing:
                    raise RuntimeError("nbflash.tma: no room left for new tensor maps inside a CUDA graph capture; "
                                       "run the call once before capturing it")
                self._new_slab()
            pointer, pinned, host = self.slabs[-1]
            offset, self.used = self.used, self.used + -(-nbytes // TENSOR_MAP_BYTES) * TENSOR_MAP_BYTES
            host[offset:offset + nbytes] = maps.reshape(-1)
            memory = cp.cuda.UnownedMemory(pointer + offset, nbytes, self, self.device)
            entry = [cp.ndarray(maps.shape, np.uint8, cp.cuda.MemoryPointer(memory, 0)), pinned.ptr + offset, False]
            self._copy(entry, stream, capturing)
            if self.SLAB_BYTES - self.used < self.AHEAD_BYTES and not capturing:
                self._new_slab()
            self.sets[key] = entry
        return entry[0]

    def _new_slab(self) -> None:
        import cupy as cp

        pinned = cp.cuda.alloc_pinned_memory(self.SLAB_BYTES)
        self.slabs.append((cp.cuda.runtime.malloc(self.SLAB_BYTES), pinned,
                           np.frombuffer(pinned, np.uint8, self.SLAB_BYTES)))
        self.used = 0

    def _copy(self, entry, stream: int, capturing: bool | None = None) -> None:
        """Copy ``entry``'s host bytes to its device array: on the private stream, waited for; or, inside a
        capture of ``stream``, as a node of the graph."""
        import cupy as cp

        array, source, _ = entry
        with cp.cuda.Device(self.device):
            if capturing is None:
                capturing = cp.cuda.runtime.streamIsCapturing(stream)
            if capturing:
                cp.cuda.runtime.memcpyAsync(array.data.ptr, source, array.nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream)
                return
            if self.stream is None:
                self.stream = cp.cuda.Stream(non_blocking=True)
            cp.cuda.runtime.memcpyAsync(array.data.ptr, source, array.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        self.stream.ptr)
            self.stream.synchronize()
            entry[2] = True


# ----------------------------------------------------------------------------
# Simulator
# ----------------------------------------------------------------------------


#: Simulator only: a completed phase's boxes are written into shared memory when a thread's
#: :func:`mbarrier_try_wait_parity` first sees the phase complete (or, if nobody waits, when the barrier's
#: next phase completes) instead of at once.  A thread that reads a stage without waiting on its
#: mbarrier then reads the old bytes unless some other thread has waited first: a kernel whose readers all
#: skip the wait fails instead of passing because the copying thread happened to run ahead
#: (``tests/test_backward_wgmma.py`` sets it).
SIM_TMA_LANDS_AT_WAIT = False


class _SimMbarrier:
    """One mbarrier: the arrivals a phase waits for, those still missing, the bytes announced and not landed."""

    def __init__(self, count):
        self.cond = threading.Condition()
        self.count = count
        self.pending = count
        self.tx = 0
        self.phase = 0
        self.copies = []  # (write, bytes) of the TMA copies issued in this phase, landed when it completes
        self.unwritten = []  # with SIM_TMA_LANDS_AT_WAIT: the writes of a completed phase nobody has waited for

    def _write_landed(self):  # with self.cond held
        for write in self.unwritten:
            write()
        self.unwritten = []

    def _maybe_complete(self):  # with self.cond held
        """Complete the phase if every arrival came and the issued copies are all the bytes announced: the copies
        land now, as late as the hardware may let them (a reader that skipped the wait sees the old bytes)."""
        if self.pending == 0 and self.tx == sum(n for _, n in self.copies):
            self._write_landed()  # the previous phase's boxes, if nobody waited for them
            self.unwritten = [write for write, _ in self.copies]
            if not SIM_TMA_LANDS_AT_WAIT:
                self._write_landed()
            self.copies = []
            self.tx = 0
            self.phase += 1
            self.pending = self.count
            self.cond.notify_all()


def _sim_barrier_key(bars, index):
    if not 0 <= int(index) < bars.size:
        raise IndexError(f"mbarrier index {index} outside the array of {bars.size}")
    if bars.dtype.itemsize != 8:
        raise ValueError(f"an mbarrier is a 64-bit word: the array must be uint64/int64, got {bars.dtype}")
    return bars.__array_interface__["data"][0] + 8 * int(index)


def _sim_mbarrier(bars, index, create_count=None):
    table = _sim_block_state("_nbflash_mbarriers", dict)
    key = _sim_barrier_key(bars, index)
    with _sim_lock:
        if create_count is not None:
            table[key] = _SimMbarrier(create_count)
        bar = table.get(key)
    if bar is None:
        raise RuntimeError(f"mbarrier {index} is used before mbarrier_init")
    return bar


def _sim_mbarrier_init(bars, index, count):
    """Make ``bars[index]`` (a ``uint64`` shared array) an mbarrier whose phases wait for ``count`` arrivals.

    PTX: ``mbarrier.init.shared.b64 [bar], count``; sm_80+.  One thread
    initialises; then :func:`fence_mbarrier_init` and a block barrier, before
    any other thread or a TMA copy uses it.  Simulator: a fresh counter in
    phase 0.
    """
    if not 0 < int(count) < 1 << 20:
        raise ValueError(f"mbarrier count must be 1..2^20-1, got {count}")
    _sim_mbarrier(bars, index, int(count))


def _sim_fence_mbarrier_init():
    """Make this thread's :func:`mbarrier_init` visible to the async proxy (the TMA unit).

    PTX: ``fence.mbarrier_init.release.cluster``; sm_90.  Simulator: nothing
    to do (the counters are shared Python objects).
    """


def _sim_mbarrier_arrive_expect_tx(bars, index, tx_bytes):
    """One arrival at ``bars[index]`` that announces ``tx_bytes`` more bytes for the current phase.

    PTX: ``mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], tx``; sm_90.
    The thread that issues the TMA copies calls it once per phase with the
    sum of their box bytes (:attr:`TensorMap.box_bytes`).
    """
    bar = _sim_mbarrier(bars, index)
    with bar.cond:
        bar.tx += int(tx_bytes)
        bar.pending -= 1
        bar._maybe_complete()


def _sim_mbarrier_arrive(bars, index):
    """One plain arrival at ``bars[index]`` (a consumer saying "I am done with this buffer").

    PTX: ``mbarrier.arrive.shared::cta.b64 _, [bar]``; sm_80+.
    """
    bar = _sim_mbarrier(bars, index)
    with bar.cond:
        bar.pending -= 1
        if bar.pending < 0:
            raise RuntimeError("more arrivals at an mbarrier than its count")
        bar._maybe_complete()


def _sim_mbarrier_try_wait_parity(bars, index, parity):
    """True once the phase of parity ``parity`` (0 or 1) of ``bars[index]`` has completed; False for now.

    PTX: ``mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity``
    (returned as 0/1); sm_90.  The hardware suspends the thread for a while
    before answering False; call it in a loop::

        while not mbarrier_try_wait_parity(bars, s, phase):
            pass

    Simulator: waits up to a millisecond for the phase, then answers.
    """
    if int(parity) not in (0, 1):
        raise ValueError(f"parity must be 0 or 1, got {parity}")
    bar = _sim_mbarrier(bars, index)
    with bar.cond:
        if bar.phase % 2 == int(parity):
            bar.cond.wait(0.001)
        done = bar.phase % 2 != int(parity)
        if done:
            bar._write_landed()
        return done


def _sim_tma_load_4d(smem, offset, tmap, c0, c1, c2, c3, bars, index):
    """Copy the box at (column c0, row c1, head c2, batch c3) of ``tmap``'s tensor into ``smem[offset:]``.

    PTX: ``cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
    [dst], [map, {c0, c1, c2, c3}], [bar]``; sm_90.  Issued by one thread; it
    returns at once, and the box's bytes complete on ``bars[index]`` as they
    land.  ``smem``: a 16-bit shared array, ``offset`` in elements, the
    destination 128-byte aligned (1024 with the 128-byte swizzle);
    ``tmap``: :attr:`TensorMap.map`.  Coordinates may run past the tensor
    (and below zero): those elements are zero.

    Simulator: the box is read here and lands, in the map's layout (swizzled
    like :func:`nbflash.hopper.kmajor_sw128_offset`), when the barrier's phase
    completes — the latest moment the hardware allows, so that a thread that
    reads without waiting sees the old bytes.
    """
    key = int(np.asarray([tmap[i] for i in range(8)], np.uint8).view(np.uint64)[0])
    spec = _SIM_MAPS.get(key)
    if spec is None:
        raise ValueError("tma_load_4d: not a tensor map from make_tensor_map")
    align = 1024 if spec.swizzle == SWIZZLE_128B else 128
    address = int(_sim_smem_address(smem, offset))
    if address % align:
        raise ValueError(f"tma_load_4d: the shared destination must be {align}-byte aligned, got {address:#x}")
    x = spec.source
    rows, cols = spec.box_rows, spec.box_cols
    box = np.zeros((rows, cols), np.uint16)
    b, h, r0, col0 = int(c3), int(c2), int(c1), int(c0)
    if 0 <= b < x.shape[0] and 0 <= h < x.shape[1]:
        rr = np.arange(r0, r0 + rows)
        cc = np.arange(col0, col0 + cols)
        rin, cin = (rr >= 0) & (rr < x.shape[2]), (cc >= 0) & (cc < x.shape[3])
        src = np.asarray(x[b, h]).view(np.uint16)
        box[np.ix_(rin, cin)] = src[np.ix_(rr[rin], cc[cin])]
    flat = smem.reshape(-1).view(np.uint16)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    if spec.swizzle == SWIZZLE_128B:
        dst = kmajor_sw128_offset(r, c) // 2  # bytes → 16-bit elements
    else:
        dst = r * cols + c
    if int(offset) + int(dst.max()) >= flat.size:
        raise IndexError("tma_load_4d: the box runs past the end of the shared array")
    where = int(offset) + dst

    def write():
        flat[where] = box

    # These bytes come through the async proxy: a wgmma may read them with no proxy fence (the simulated wgmma's
    # check for tiles written by ordinary stores does not apply to a block fed by TMA).
    fenced = _sim_block_fenced()
    with _sim_lock:
        fenced[0] = True
    bar = _sim_mbarrier(bars, index)
    with bar.cond:
        bar.copies.append((write, spec.box_bytes))
        bar._maybe_complete()


# ----------------------------------------------------------------------------
# GPU: inline PTX
# ----------------------------------------------------------------------------


def _is_u64_array(ty):
    return _is_flat_array(ty) and isinstance(ty.dtype, types.Integer) and ty.dtype.bitwidth == 64


def _make_gpu_barrier_op(name: str, ptx: str, flag: bool = False):
    """An intrinsic ``op(bars, index, value)``: the PTX ``ptx`` on the shared address of ``bars[index]`` and
    ``value`` as a 32-bit integer ($0 and $1), kept in place as a memory operation.  With ``flag`` it returns
    a boolean: ``ptx`` writes 0 or 1 to $0 and the address and value are $1 and $2."""

    def op(typingctx, bars, index, value):
        if not (_is_u64_array(bars) and _is_int(index, value)):
            return None

        def codegen(context, builder, sig, args):
            bar = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            n = context.cast(builder, args[2], sig.args[2], types.uint32)
            if not flag:
                _asm(builder, ir.VoidType(), [_I32, _I32], ptx, "r,r,~{memory}", [bar, n], side_effect=True)
                return context.get_dummy_value()
            done = _asm(builder, _I32, [_I32, _I32], ptx, "=r,r,r,~{memory}", [bar, n], side_effect=True)
            return builder.icmp_unsigned("!=", done, ir.Constant(_I32, 0))

        return (types.boolean if flag else types.void)(bars, index, value), codegen

    op.__name__ = name
    return intrinsic(op)


@intrinsic
def _gpu_mbarrier_arrive(typingctx, bars, index):
    if not (_is_u64_array(bars) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        bar = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        _asm(builder, ir.VoidType(), [_I32], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}", [bar],
             side_effect=True)
        return context.get_dummy_value()

    return types.void(bars, index), codegen


@intrinsic
def _gpu_tma_load_4d(typingctx, smem, offset, tmap, c0, c1, c2, c3, bars, index):
    if not (_is_flat_array(smem) and isinstance(tmap, types.Array) and _is_u64_array(bars)
            and _is_int(offset, c0, c1, c2, c3, index)):
        return None

    def codegen(context, builder, sig, args):
        dst = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        map_address = _global_address(context, builder, sig.args[2], args[2], types.intp,
                                      ir.Constant(ir.IntType(64), 0))
        coords = [context.cast(builder, a, t, types.int32) for a, t in zip(args[3:7], sig.args[3:7], strict=True)]
        bar = _shared_address(context, builder, sig.args[7], args[7], sig.args[8], args[8])
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32, _I32, _I32, _I32],
             "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
             "[$0], [$1, {$2, $3, $4, $5}], [$6];", "r,l,r,r,r,r,r,~{memory}",
             [dst, map_address, *coords, bar], side_effect=True)
        return context.get_dummy_value()

    return types.void(smem, offset, tmap, c0, c1, c2, c3, bars, index), codegen


mbarrier_init = _public(_sim_mbarrier_init, lambda: _make_gpu_barrier_op(
    "mbarrier_init", "mbarrier.init.shared.b64 [$0], $1;"))
fence_mbarrier_init = _public(_sim_fence_mbarrier_init, lambda: _make_gpu_statement(
    "fence_mbarrier_init", "fence.mbarrier_init.release.cluster;"))
mbarrier_arrive_expect_tx = _public(_sim_mbarrier_arrive_expect_tx, lambda: _make_gpu_barrier_op(
    "mbarrier_arrive_expect_tx", "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"))
mbarrier_arrive = _public(_sim_mbarrier_arrive, lambda: _gpu_mbarrier_arrive)
mbarrier_try_wait_parity = _public(_sim_mbarrier_try_wait_parity, lambda: _make_gpu_barrier_op(
    "mbarrier_try_wait_parity",
    "{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; selp.u32 $0, 1, 0, done; }",
    flag=True))
tma_load_4d = _public(_sim_tma_load_4d, lambda: _gpu_tma_load_4d)
