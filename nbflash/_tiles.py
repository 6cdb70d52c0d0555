"""Tile plumbing shared by the kernels: SIMT configurations, shared-memory carving, tile loads and copies.

A *configuration* fixes every compile-time constant of a kernel: the tile
sizes ``BLOCK_M`` (queries) and ``BLOCK_N`` (keys), the padded head dim, the
thread layout and the element types.  Kernel factories are cached on it, so
each configuration compiles once.

Thread layout.  A block has ``THREADS_Y × THREADS_X`` threads; thread
``(ty, tx)`` (linear id ``ty * THREADS_X + tx``) owns the rows
``ty, ty + THREADS_Y, ty + 2·THREADS_Y, …`` of a tile and the columns
``tx, tx + THREADS_X, …``.  ``THREADS_X`` is a power of two ≤ 32, so the
``THREADS_X`` threads that share a row are lanes of one warp: a row's max or
sum is a butterfly of warp shuffles, and a row written to shared memory by
those lanes needs only a warp barrier before they read it back.

Along the head dim a thread owns ``DCOLS = head_dim_pad / THREADS_X`` columns
(of the output ``O``, of ``dK``, ``dV``, ``dQ``) in runs of ``CHUNK``
(:func:`d_chunk`): run ``c`` is the columns ``c·CHUNK·THREADS_X + tx·CHUNK +
[0, CHUNK)``.  By default one run (``CHUNK = DCOLS``: columns ``tx·DCOLS …``).
With ``interleave`` the runs are one 16-byte vector wide, so that one vector
load by the lanes of a row reads consecutive addresses (at ``DCOLS = 8``
contiguous runs put lanes ``tx`` and ``tx + 4`` on the same banks)::

    DCOLS = 8, THREADS_X = 16, columns of lane tx
      contiguous:   tx·8 … tx·8 + 7
      interleave:   tx·4 … tx·4 + 3   and   64 + tx·4 … 64 + tx·4 + 3

A block may also hold ``groups`` copies of the ``THREADS_Y × THREADS_X``
layout (``threadIdx.z``), which split the work between them — the dK/dV kernel
of the backward pass uses two: one computes ``P`` and ``dV``, the other
``dP``, ``dS`` and ``dK``.  Tile loads use every thread of the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import intrinsics as I
from ._device import SIMULATOR, compute_capability, cuda, device_function, numba, shfl_xor
from ._validate import chunked_rows_problem

#: Element types a kernel can read from global memory.  bfloat16 arrives as its
#: raw 16 bits (uint16) because CuPy and NumPy have no bfloat16.
INPUT_KINDS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class TileConfig:
    """Compile-time constants of one SIMT kernel."""

    block_m: int  # query rows per tile (BLOCK_M)
    block_n: int  # key rows per tile (BLOCK_N)
    head_dim_pad: int  # head dim rounded up to a multiple of threads_x
    threads_x: int  # lanes sharing a row: a power of two <= 32
    threads_y: int
    input_kind: str  # one of INPUT_KINDS
    acc_kind: str = "float32"  # accumulate and keep tiles in float32 (float64 for float64 inputs)
    trace: bool = False  # record m_i and l_i after every key tile (the teaching demo)
    min_blocks: int = 0  # if > 0: launch bounds asking for this many resident blocks per SM
    groups: int = 1  # copies of the thread layout (threadIdx.z); only the backward's dK/dV kernel takes 2
    interleave: bool = False  # head-dim columns in 16-byte runs (see the module docstring), not one run
    longest_first: bool = False  # grid order: every head's longest tile first (see grid_shape)
    async_copy: bool = False  # float32 tiles copied by cp.async (make_async_tile_loader), overlapping the maths

    def __post_init__(self):
        tx, ty = self.threads_x, self.threads_y
        if tx & (tx - 1) or not 1 <= tx <= 32:
            raise ValueError(f"threads_x must be a power of two <= 32, got {tx}")
        for name, size, div in (
            ("block_m", self.block_m, ty),
            ("block_n", self.block_n, tx),
            ("head_dim_pad", self.head_dim_pad, tx),
        ):
            if size <= 0 or size % div:
                raise ValueError(f"{name}={size} must be a positive multiple of {div}")
        if self.input_kind not in INPUT_KINDS:
            raise ValueError(f"input_kind must be one of {INPUT_KINDS}, got {self.input_kind!r}")
        if self.async_copy and (self.input_kind != "float32" or self.head_dim_pad % 4):
            raise ValueError(
                "async_copy copies float32 rows in 16-byte chunks: it needs input_kind='float32' and a head_dim_pad"
                f" that is a multiple of 4, got {self.input_kind!r} and {self.head_dim_pad}"
            )
        if self.groups not in (1, 2):
            raise ValueError(f"groups must be 1 or 2, got {self.groups}")
        # The backward's atomic dQ step gives each group its own share of the head dim.
        step = tx * self.groups * (16 // self.acc_itemsize if self.interleave else 1)
        if self.head_dim_pad % step:
            raise ValueError(
                f"head_dim_pad={self.head_dim_pad} must be a multiple of {step} (threads_x · groups"
                f"{' · one 16-byte vector' if self.interleave else ''})"
            )

    @property
    def threads(self) -> int:
        return self.threads_x * self.threads_y * self.groups

    @property
    def acc_itemsize(self) -> int:
        return 8 if self.acc_kind == "float64" else 4


def pad_head_dim(head_dim: int, multiple: int) -> int:
    """Round ``head_dim`` up to a multiple of ``multiple``."""
    return -(-head_dim // multiple) * multiple


def numba_type(kind: str):
    return {"float32": numba.float32, "float64": numba.float64}[kind]


LOG2E = 1.0 / math.log(2.0)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)


def vector_width(cfg: TileConfig) -> int:
    """Elements per vector load from shared memory: 16 bytes (4 floats, 2 doubles) when the
    tile widths allow it, else the largest power of two dividing ``head_dim_pad`` and ``block_n``."""
    vec = 16 // cfg.acc_itemsize
    while cfg.head_dim_pad % vec or cfg.block_n % vec:
        vec //= 2
    return vec


def grid_shape(cfg: TileConfig, tiles: int, heads: int, batch: int) -> tuple[int, int, int]:
    """The launch grid for ``tiles`` tiles of each of ``batch × heads`` sequences; see :func:`make_block_tile`.

    The GPU starts blocks in order of their linear index (``x`` fastest).  By
    default ``x`` is the tile, so the blocks of one (batch, head) start
    together and share its K and V in L2.  With ``cfg.longest_first`` the tile
    is ``z``: the longest tile of every (batch, head) starts before any
    shorter one, which leaves only short blocks for the end of a causal grid
    (the greedy "longest job first" schedule), at the price of that L2 sharing.
    """
    return (heads, batch, tiles) if cfg.longest_first else (tiles, heads, batch)


def make_block_tile(cfg: TileConfig, reverse: bool = False):
    """Device function: ``(tile, h, b)`` of this block in a grid of :func:`grid_shape`.

    Tiles start in the order ``0, 1, 2, …`` — or, with ``reverse``, from the
    last tile down (the forward's and dQ's last query tiles have the most keys).
    """
    LONGEST_FIRST, REVERSE = cfg.longest_first, reverse

    def block_tile():
        if LONGEST_FIRST:
            rank, tiles, h, b = cuda.blockIdx.z, cuda.gridDim.z, cuda.blockIdx.x, cuda.blockIdx.y
        else:
            rank, tiles, h, b = cuda.blockIdx.x, cuda.gridDim.x, cuda.blockIdx.y, cuda.blockIdx.z
        return (tiles - 1 - rank if REVERSE else rank), h, b

    return device_function(block_tile)


def make_d_column(cfg: TileConfig, columns: int | None = None):
    """Device function ``d_column(tx, e)``: the ``e``-th head-dim column of lane ``tx`` (module docstring).

    ``columns``: how many columns each thread owns (default ``head_dim_pad / threads_x``).
    """
    CHUNK = d_chunk(cfg, columns)
    STRIDE = CHUNK * cfg.threads_x

    def d_column(tx, e):
        return (e // CHUNK) * STRIDE + tx * CHUNK + e % CHUNK

    return device_function(d_column)


def d_chunk(cfg: TileConfig, columns: int | None = None) -> int:
    """Width of a thread's runs of head-dim columns (see the module docstring).

    ``columns``: how many columns each thread owns (default ``head_dim_pad / threads_x``).
    """
    columns = cfg.head_dim_pad // cfg.threads_x if columns is None else columns
    return min(16 // cfg.acc_itemsize, columns) if cfg.interleave else columns


def make_loader(input_kind: str, acc_kind: str):
    """Device function: one element read from global memory, converted to the accumulator type."""
    acc_t = numba_type(acc_kind)
    if input_kind == "bfloat16":
        # bf16 is the top half of a float32: shift its 16 bits up and reinterpret.
        if SIMULATOR:

            def to_acc(x):
                bits = np.uint32(x) << np.uint32(16)
                return acc_t(np.array([bits], dtype=np.uint32).view(np.float32)[0])

        else:
            from numba.cuda import libdevice

            def to_acc(x):
                return acc_t(libdevice.int_as_float(numba.int32(numba.uint32(x) << 16)))

        return device_function(to_acc)

    def to_acc(x):
        return acc_t(x)

    return device_function(to_acc)


def make_storer(output_kind: str):
    """Device function: convert an accumulator value to the output element type."""
    if output_kind == "bfloat16":
        # Round to nearest even on the 16 bits we keep (inputs here are finite or inf).
        if SIMULATOR:

            def to_out(x):
                bits = np.array([np.float32(x)], dtype=np.float32).view(np.uint32)[0]
                bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
                return np.uint16(bits >> np.uint32(16))

        else:
            from numba.cuda import libdevice

            def to_out(x):
                bits = numba.uint32(libdevice.float_as_int(numba.float32(x)))
                bits = bits + numba.uint32(0x7FFF) + ((bits >> 16) & numba.uint32(1))
                return numba.uint16(bits >> 16)

        return device_function(to_out)
    out_t = {"float16": numba.types.float16, "float32": numba.float32, "float64": numba.float64}[output_kind]

    def to_out(x):
        return out_t(x)

    return device_function(to_out)


def make_tile_loader(cfg: TileConfig):
    """Device function that copies rows ``[start, start + rows)`` of one (batch, head) into shared memory.

    The tile lands at ``dst[offset + r * pitch + d]``.

    Consecutive lanes read consecutive elements of a row, so a warp's loads
    coalesce.  Rows past ``seqlen`` and columns past ``head_dim`` are filled
    with zeros: a padded element then adds nothing to any dot product, and no
    uninitialised value (possibly NaN) can reach an output.
    """
    THREADS_X = cfg.threads_x
    THREADS_Y = cfg.threads // THREADS_X  # every thread of the block, all groups
    D_PAD = cfg.head_dim_pad
    to_acc = make_loader(cfg.input_kind, cfg.acc_kind)
    zero = numba_type(cfg.acc_kind)(0)
    u64 = numba.uint64

    def load_tile(dst, offset, pitch, src, b, h, start, rows, seqlen, head_dim, tid):
        # Thread (ty, tx) copies rows ty, ty + THREADS_Y, ... and in each the
        # columns tx, tx + THREADS_X, ...  Indices are unsigned so Numba adds no
        # negative-index wraparound to each of the four global indices.
        ty = tid // THREADS_X
        tx = tid - ty * THREADS_X
        b_u, h_u = u64(b), u64(h)
        for r in range(ty, rows, THREADS_Y):
            base = u64(offset) + u64(r) * u64(pitch)
            row = start + r
            if row < seqlen:
                row_u = u64(row)
                for d in range(tx, D_PAD, THREADS_X):
                    if d < head_dim:
                        dst[base + u64(d)] = to_acc(src[b_u, h_u, row_u, u64(d)])
                    else:
                        dst[base + u64(d)] = zero
            else:
                for d in range(tx, D_PAD, THREADS_X):
                    dst[base + u64(d)] = zero

    return device_function(load_tile)


def make_async_tile_loader(cfg: TileConfig):
    """Device function that *starts* copying rows ``[start, start + rows)`` of one (batch, head) into shared memory.

    The same tile as :func:`make_tile_loader` (``dst[offset + r * pitch + d]``,
    zeros past ``seqlen`` and past ``head_dim``), moved by ``cp.async`` in
    16-byte chunks of four float32 that bypass the registers: the copy runs
    while the block computes, and lands once the thread has committed it and
    waited (``cp_async_commit``, ``cp_async_wait_all``) — then a barrier makes
    it visible to the other threads.  Float32 inputs only, ``head_dim`` a
    multiple of 4 and every row 16-byte aligned (:func:`async_copy_ok`).

    Consecutive threads take consecutive chunks, so a warp reads whole rows.
    A chunk past the end reads nothing (source size 0) from a clamped, valid
    address and writes 16 zero bytes.
    """
    THREADS = cfg.threads
    CHUNKS = cfg.head_dim_pad // 4  # 16-byte chunks per row
    u64 = numba.uint64
    U_THREADS, U_CHUNKS = u64(THREADS), u64(CHUNKS)

    def load_tile_async(dst, offset, pitch, src, b, h, start, rows, seqlen, head_dim, tid):
        b_u, h_u = u64(b), u64(h)
        last_col = u64(head_dim - 4)  # head_dim ≥ 4: a multiple of 4
        for c in range(u64(tid), u64(rows) * U_CHUNKS, U_THREADS):
            r = c // U_CHUNKS
            col = (c - r * U_CHUNKS) * u64(4)
            row = u64(start) + r
            nbytes = 16 if row < u64(seqlen) and col < u64(head_dim) else 0
            src_row = min(row, u64(seqlen - 1))  # a valid address even when nothing is read
            I.cp_async_16(dst, u64(offset) + r * u64(pitch) + col, src, (b_u, h_u, src_row, min(col, last_col)), nbytes)

    return device_function(load_tile_async)


def make_tc_tile_copier(rows: int, threads: int, head_dim: int, chunks: int, dst_offset):
    """``copy(smem, offset, src, b, h, start, seqlen, tid)``: ``cp.async`` rows ``[start, start + rows)`` of
    ``src[b, h]`` (16-bit elements) into a shared tile, for the tensor-core kernels.

    A row is ``chunks`` 16-byte chunks in shared memory, of which the first
    ``head_dim / 8`` hold data; the others (head-dim padding) and rows past
    ``seqlen`` are zero-filled (a copy of 0 source bytes from a valid
    address).  ``dst_offset(offset, r, chunk)`` (a device function) places
    chunk ``chunk`` of tile row ``r``: a padded pitch, or a swizzle.

    The ``threads`` threads copy the chunks ``tid, tid + threads, …``.  When
    ``threads`` is a multiple of ``chunks``, a thread copies the same chunk
    column of rows ``tid // chunks + it · threads / chunks``, and a tile that
    lies wholly inside the sequence (every tile but the ragged last one) takes
    the short path: one global address per tile, the thread's next rows one
    row stride further (:func:`~nbflash.intrinsics.cp_async_16_at`) — two
    additions per chunk where the general path spends about twenty
    instructions on a 4-index address, a clamp and a bound test.  All index
    arithmetic is unsigned, so ``//`` and ``%`` by powers of two are shifts
    and masks, and the loops have constant trip counts (unrolled).
    """
    DATA = head_dim // 8  # chunks that hold data
    ITERS = -(-rows * chunks // threads)
    EXACT = rows * chunks % threads == 0
    SAME_CHUNK = threads % chunks == 0
    u64, i64 = numba.uint64, numba.int64
    U_CHUNKS, U_THREADS, U_TOTAL, U_DATA, U_ROWS = (np.uint64(x) for x in (chunks, threads, rows * chunks, DATA, rows))
    U_ROW_STEP, I_ROW_STEP = np.uint64(threads // chunks), np.int64(threads // chunks)

    def copy_tile(smem, offset, src, b, h, start, seqlen, tid):
        if SAME_CHUNK and u64(start) + U_ROWS <= u64(seqlen):  # a whole tile: no row is past the end
            pinned = u64(I.pinned_u32(tid))  # addresses computed here, not held through the caller's loop
            r0 = pinned // U_CHUNKS
            chunk = pinned % U_CHUNKS
            nbytes = 16 if DATA == chunks or chunk < U_DATA else 0
            address = I.global_address(src, (b, h, u64(start) + r0, min(chunk, U_DATA - u64(1)) * u64(8)))
            step = i64(src.strides[2]) * I_ROW_STEP  # bytes from one of the thread's rows to its next
            for it in range(ITERS):
                r = r0 + u64(it) * U_ROW_STEP
                if EXACT or r < U_ROWS:
                    I.cp_async_16_at(smem, dst_offset(offset, r, chunk), address, nbytes)
                address += step
        else:
            for it in range(ITERS):
                c = u64(tid) + u64(it) * U_THREADS
                if EXACT or c < U_TOTAL:
                    if SAME_CHUNK:
                        r = u64(tid) // U_CHUNKS + u64(it) * U_ROW_STEP
                        chunk = u64(tid) % U_CHUNKS
                    else:
                        r = c // U_CHUNKS
                        chunk = c % U_CHUNKS
                    row = u64(start) + r
                    nbytes = 16 if row < u64(seqlen) and (DATA == chunks or chunk < U_DATA) else 0
                    row = min(row, u64(seqlen - 1))  # a valid address even when nothing is read
                    col = min(chunk, U_DATA - u64(1)) * u64(8)
                    I.cp_async_16(smem, dst_offset(offset, r, chunk), src, (b, h, row, col), nbytes)

    return device_function(copy_tile)


def make_padded_offset(pitch: int):
    """``dst_offset(offset, r, chunk)`` for :func:`make_tc_tile_copier`: rows ``pitch`` elements apart, chunk
    ``chunk`` at element ``8 · chunk`` of its row."""
    U_PITCH = np.uint64(pitch)
    u64 = numba.uint64

    def padded_offset(offset, r, chunk):
        return u64(offset) + r * U_PITCH + chunk * u64(8)

    return device_function(padded_offset)


def make_pair_stager(input_kind: str, pitch: int, m_tiles: int, n_tiles: int):
    """``stage(smem32, offset, acc, sc, row_g, col0, t)``: a warp's mma accumulators ``acc · sc`` packed to 16
    bits into a shared tile, one 32-bit store per pair, for :func:`make_tc_tile_storer` to write out.

    ``acc`` holds ``16 · m_tiles`` rows × ``8 · n_tiles`` columns (tile ``m · n_tiles + n``; the thread's pairs
    at rows g, g + 8 and columns 2t, 2t + 1 of each); they land at tile rows ``row_g + 16m (+ 8)`` (``row_g``:
    the tile row of the thread's g) and columns ``col0 + 8n + 2t``, the tile at element ``offset`` with rows
    ``pitch`` elements apart.  A pitch of a multiple of 16 plus 8 puts the 32 lanes of one store in 32 banks.
    """
    pack = I.pack_f16x2 if input_kind == "float16" else I.pack_bf16x2  # the first value in the low half
    u32 = numba.uint32

    @device_function
    def stage(smem32, offset, acc, sc, row_g, col0, t):
        word = u32((offset + row_g * pitch + col0) // 2 + t)  # the thread's first pair (32-bit words)
        for m in range(m_tiles):
            for r in range(2):
                for n in range(n_tiles):
                    x = m * n_tiles + n
                    smem32[word + u32((16 * m + 8 * r) * pitch // 2 + 4 * n)] = pack(acc[x, 2 * r] * sc,
                                                                                    acc[x, 2 * r + 1] * sc)

    return stage


def make_tc_tile_storer(rows: int, lanes: int, head_dim: int, src_offset, slice_cols: int = 0):
    """``store(smem, offset, dst, b, h, start, seqlen, lane)``: rows ``[start, start + rows)`` of ``dst[b, h]``
    (16-bit elements) from a shared tile, by ``lanes`` lanes of one warp — the reverse of
    :func:`make_tc_tile_copier`, for an output tile staged in shared memory.

    Each 16-byte chunk of data (``head_dim / 8`` per row; the head-dim padding
    of the shared row is not written) is one ``ld.shared.v4`` and one
    ``st.global.v4``; consecutive lanes take consecutive chunks, so a row of
    128 elements is 256 contiguous bytes written by 16 lanes in one request,
    every 32-byte sector whole.  Rows at or past ``seqlen`` are skipped.
    ``src_offset(offset, r, chunk)`` places chunk ``chunk`` of tile row ``r``
    in shared memory (as for the copier).  When ``lanes`` is a multiple of the
    chunks per row, a lane stores the same chunk column of rows ``lane //
    chunks + it · lanes / chunks``, from one global address plus row strides.
    ``dst`` must have its rows contiguous along D and 16-byte aligned (the
    tensor-core kernels' :func:`~nbflash._validate.tile_rows_problem` rule).

    With ``slice_cols`` the tile is one slice of a wider ``dst`` (a block's
    share of the head dim): ``store(..., lane, col0)`` writes its
    ``slice_cols / 8`` chunks to columns ``col0 ...`` (a run-time multiple of
    8), skipping those at or past ``head_dim`` (a last slice partly padding).
    """
    SLICED = slice_cols > 0
    DATA = (slice_cols if SLICED else head_dim) // 8  # chunks of a tile row that may hold data
    ITERS = -(-rows * DATA // lanes)
    EXACT = rows * DATA % lanes == 0
    SAME_CHUNK = lanes % DATA == 0
    u64, i64 = numba.uint64, numba.int64
    U_DATA, U_LANES, U_TOTAL, U_D = (np.uint64(x) for x in (DATA, lanes, rows * DATA, head_dim))
    U_ROW_STEP, I_ROW_STEP = np.uint64(lanes // DATA), np.int64(lanes // DATA)

    def store_slice(smem, offset, dst, b, h, start, seqlen, lane, col0):
        if SAME_CHUNK:
            r0 = u64(lane) // U_DATA
            chunk = u64(lane) % U_DATA
            col = u64(col0) + chunk * u64(8)
            address = I.global_address(dst, (b, h, u64(start) + r0, col))
            step = i64(dst.strides[2]) * I_ROW_STEP  # bytes from one of the lane's rows to its next
            for it in range(ITERS):
                r = r0 + u64(it) * U_ROW_STEP
                if (EXACT or r < u64(rows)) and u64(start) + r < u64(seqlen) and (not SLICED or col < U_D):
                    w0, w1, w2, w3 = I.ld_shared_v4_b32(smem, src_offset(offset, r, chunk))
                    I.st_global_v4_b32(address, w0, w1, w2, w3)
                address += step
        else:
            for it in range(ITERS):
                c = u64(lane) + u64(it) * U_LANES
                r = c // U_DATA
                chunk = c % U_DATA
                col = u64(col0) + chunk * u64(8)
                if (EXACT or c < U_TOTAL) and u64(start) + r < u64(seqlen) and (not SLICED or col < U_D):
                    w0, w1, w2, w3 = I.ld_shared_v4_b32(smem, src_offset(offset, r, chunk))
                    I.st_global_v4_b32(I.global_address(dst, (b, h, u64(start) + r, col)), w0, w1, w2, w3)

    store = device_function(store_slice)
    if SLICED:
        return store

    def store_tile(smem, offset, dst, b, h, start, seqlen, lane):
        store(smem, offset, dst, b, h, start, seqlen, lane, 0)

    return device_function(store_tile)


def async_copy_ok(cfg: TileConfig, *arrays, names=("q", "k", "v")) -> tuple[bool, str]:
    """Can ``cfg`` with ``async_copy`` read these arrays (canonical views or descriptors)?  ``(ok, reason)``.

    ``cp.async`` copies float32 rows in 16-byte chunks
    (:func:`make_async_tile_loader`): the head dim a multiple of 4, each array
    contiguous along it, its other strides and its data pointer multiples of
    16 bytes; and a GPU of compute capability 8.0 or newer (the simulator
    emulates the instruction).  ``names`` name the arrays in the reason (the
    forward's q, k, v by default; the backward passes its own).
    """
    if cfg.input_kind != "float32":
        return False, f"cp.async copies float32 tiles as they are; {cfg.input_kind} is converted on load"
    cc = compute_capability()
    if cc is not None and cc < (8, 0):
        return False, f"cp.async needs compute capability 8.0, the device has {cc}"
    for name, a in zip(names, arrays, strict=True):
        if a.shape[-1] % 4:
            return False, f"{name}'s head dim {a.shape[-1]} is not a multiple of 4 (16-byte chunks)"
        why = chunked_rows_problem(name, a, 4)
        if why:
            return False, why
    return True, ""


def make_mm_nt(rows: int, cols: int, depth: int, pitch: int, vec: int, acc_kind: str):
    """Device function for one thread's piece of ``A Bᵀ``, both operands stored as rows in shared memory.

    ``mm_nt(acc, smem, a_off, a_rows, b_off, b_rows)`` adds, for ``r < rows``, ``c < cols``::

        acc[r, c] += Σ_{d < depth}  A[a_rows[r], d] · B[b_rows[c], d]

    where row ``i`` of A starts at ``smem[a_off + i·pitch]`` (likewise B).  This
    is ``S = Q_i K_jᵀ`` and ``dP = dO_i V_jᵀ``: a dot product of a query row
    and a key row.  ``vec`` consecutive elements of each row are read at once
    (one 16-byte load when ``vec·itemsize = 16``); every thread then does
    ``rows·cols·vec`` FMAs per ``rows + cols`` loads.  Row indices are unsigned
    (Numba adds a negative-index wraparound to every signed index).
    """
    acc_t = numba_type(acc_kind)
    u64 = numba.uint64
    DEPTH, PITCH, VEC = u64(depth), u64(pitch), u64(vec)

    def mm_nt(acc, smem, a_off, a_rows, b_off, b_rows):
        a_v = cuda.local.array((rows, vec), acc_t)
        b_v = cuda.local.array((cols, vec), acc_t)
        for d0 in range(0, DEPTH, VEC):
            for r in range(rows):
                for i in range(VEC):
                    a_v[r, i] = smem[a_off + a_rows[r] * PITCH + d0 + i]
            for c in range(cols):
                for i in range(VEC):
                    b_v[c, i] = smem[b_off + b_rows[c] * PITCH + d0 + i]
            for i in range(VEC):
                for r in range(rows):
                    for c in range(cols):
                        acc[r, c] += a_v[r, i] * b_v[c, i]

    return device_function(mm_nt)


def make_mm_nn(rows: int, cols: int, depth: int, a_pitch: int, b_pitch: int, vec: int, acc_kind: str):
    """Device function for one thread's piece of ``A B``: rows of A times columns of B, from shared memory.

    ``mm_nn(acc, smem, a_off, a_rows, b_off, b_cols)`` adds, for ``r < rows``, ``e < cols``::

        acc[r, e] += Σ_{n < depth}  A[a_rows[r], n] · B[n, b_cols[e]]

    with ``A[i, n] = smem[a_off + i·a_pitch + n]`` and ``B[n, j] =
    smem[b_off + n·b_pitch + j]``.  This is ``acc += P V_j`` in the forward
    and ``dV_j += Pᵀ dO_i``, ``dK_j += dSᵀ Q_i``, ``dQ_i += dS K_j`` in the
    backward.  A is read ``vec`` elements at a time along its rows; a thread's
    columns of B should be consecutive (``tx·cols + e``) so that they too are
    read in vectors.
    """
    acc_t = numba_type(acc_kind)
    u64 = numba.uint64
    DEPTH, A_PITCH, B_PITCH, VEC = u64(depth), u64(a_pitch), u64(b_pitch), u64(vec)

    def mm_nn(acc, smem, a_off, a_rows, b_off, b_cols):
        a_v = cuda.local.array((rows, vec), acc_t)
        b_e = cuda.local.array(cols, acc_t)
        for n0 in range(0, DEPTH, VEC):
            for r in range(rows):
                for i in range(VEC):
                    a_v[r, i] = smem[a_off + a_rows[r] * A_PITCH + n0 + i]
            for i in range(VEC):
                for e in range(cols):
                    b_e[e] = smem[b_off + (n0 + i) * B_PITCH + b_cols[e]]
                for r in range(rows):
                    for e in range(cols):
                        acc[r, e] += a_v[r, i] * b_e[e]

    return device_function(mm_nn)


def make_row_reducers(threads_x: int):
    """Device functions: max and sum of a value over the ``threads_x`` lanes that share a row.

    A butterfly of ``shfl.sync.bfly``: after log2(threads_x) exchanges every
    lane holds the full result.
    """
    STEPS = int(math.log2(threads_x))
    FULL = 0xFFFFFFFF

    def row_max(x):
        for i in range(STEPS):
            x = max(x, shfl_xor(FULL, x, threads_x >> (i + 1)))
        return x

    def row_sum(x):
        for i in range(STEPS):
            x += shfl_xor(FULL, x, threads_x >> (i + 1))
        return x

    return device_function(row_max), device_function(row_sum)


__all__ = [
    "INPUT_KINDS",
    "LN2",
    "LOG2E",
    "TileConfig",
    "async_copy_ok",
    "cuda",
    "d_chunk",
    "grid_shape",
    "make_async_tile_loader",
    "make_block_tile",
    "make_d_column",
    "make_loader",
    "make_mm_nn",
    "make_mm_nt",
    "make_row_reducers",
    "make_padded_offset",
    "make_storer",
    "make_tc_tile_copier",
    "make_tile_loader",
    "numba_type",
    "pad_head_dim",
    "vector_width",
]


class HeadDimSlices:
    """The head-dim slices of a backward configuration (a mixin of the tensor-core backward configs).

    A block owns the gradient columns of one slice of the padded head dim: ``d_slice`` columns (0: all of
    ``d_pad``), one block per slice, so that its dK, dV (or dQ) accumulators fit in registers at large head
    dims.  The class provides the derived sizes; the config provides ``d_pad`` and ``d_slice``.
    """

    @property
    def slice_cols(self) -> int:
        """Gradient columns of one block."""
        return self.d_slice or self.d_pad

    @property
    def slices(self) -> int:
        """Blocks per tile of stationary rows, one per slice of the head dim."""
        return -(-self.d_pad // self.slice_cols)

    @property
    def d_smem(self) -> int:
        """Columns of the shared tiles: every slice whole (≥ d_pad; the columns past the head dim are zero)."""
        return self.slices * self.slice_cols

    def block_tile(self, rows: int, last_first: bool = False):
        """``(start, c0) = block_tile()``: a device function giving this block's first stationary row and first
        gradient column, for a grid whose x index runs over (tile of ``rows`` rows, slice), the slices of a
        tile side by side.  ``last_first``: the tiles in reverse order (the longest causal query rows first).
        With one slice the index is the tile itself, spelt without a division (the kernels' old code)."""
        SLICES, SLICE = self.slices, self.slice_cols

        def block_tile():
            if SLICES == 1:
                tile = cuda.gridDim.x - 1 - cuda.blockIdx.x if last_first else cuda.blockIdx.x
                return tile * rows, 0
            tile = cuda.blockIdx.x // SLICES
            if last_first:
                tile = cuda.gridDim.x // SLICES - 1 - tile
            return tile * rows, (cuda.blockIdx.x % SLICES) * SLICE

        return device_function(block_tile)
