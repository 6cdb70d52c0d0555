"""Which (query, key) pairs attend to each other — written once, used by every kernel.

Causal attention in nbflash is aligned to the **bottom-right** corner, as in
flash-attn ≥ 2.1: with ``shift = seqlen_k - seqlen_q``, query ``i`` sees key ``j``
iff ``j <= i + shift``.  When ``seqlen_q == seqlen_k`` this is the usual lower
triangle; when the query is shorter (decoding with a KV cache) the last query
sees every key; when the query is longer, the first rows see nothing::

    seqlen_q=2, seqlen_k=5        seqlen_q=5, seqlen_k=2
    (shift = +3)                  (shift = -3)
          keys                          keys
          0 1 2 3 4                     0 1
    q0    x x x x .               q0    . .     <- sees no key: output 0,
    q1    x x x x x               q1    . .        lse = -inf
                                  q2    . .
                                  q3    x .
                                  q4    x x

Kernels never build this matrix.  They ask three questions of it, and the
answers come from the functions below (compiled as device functions in
:mod:`nbflash._device`; the plain Python versions are used on the host):

* :func:`key_range` — which key tiles can a query tile see at all?  Tiles
  entirely above the diagonal are skipped, never computed and masked.
* :func:`query_range` — which query tiles can see a key tile (the backward
  pass, parallel over keys, loops over these)?
* :func:`tile_needs_mask` / :func:`row_key_end` — does a tile straddle the
  diagonal or the ragged end of a sequence, and then which keys does each
  row keep (always a prefix ``[0, row_key_end)``)?  :func:`key_query_range`
  is the same answer read down a column (the backward's transposed tiles):
  the queries that see one key are always a suffix ``[begin, seqlen_q)``, or
  none for a key past ``seqlen_k`` (:func:`key_columns`: the same within a
  tile's columns).  :func:`first_masked_tile`
  gives the same answer for a whole row of key tiles at once: the tiles that
  need a mask are the last ones, so a kernel can run the others in a loop with
  no mask code at all.

Later features (sliding windows, variable lengths, GQA) change these
functions, not the kernels.
"""

from __future__ import annotations

import types

from ._device import device_function


def _row_key_end(i, seqlen_q, seqlen_k, causal):
    """Query ``i`` sees exactly the keys ``[0, end)``; ``end`` is 0 for a row past ``seqlen_q``.

    Every other question below is answered from this one: a row's visible keys
    are always a prefix.
    """
    if i >= seqlen_q:
        return 0
    if causal:
        return max(min(seqlen_k, i + seqlen_k - seqlen_q + 1), 0)
    return seqlen_k


def _key_range(q_start, block_m, seqlen_q, seqlen_k, causal):
    """Keys ``[0, end)`` that at least one query of rows ``[q_start, q_start + block_m)`` sees.

    ``end`` may be 0 (causal with seqlen_q > seqlen_k): the tile sees no key.
    """
    last_q = min(q_start + block_m, seqlen_q) - 1
    return 0, _row_key_end(last_q, seqlen_q, seqlen_k, causal)


def _query_range(k_start, block_n, seqlen_q, seqlen_k, causal):
    """Queries ``[begin, seqlen_q)`` that see at least one key of ``[k_start, k_start + block_n)``.

    The first such query is the first row whose visible prefix reaches past ``k_start``.
    """
    begin = 0
    if causal:
        begin = min(max(k_start - (seqlen_k - seqlen_q), 0), seqlen_q)
    return begin, seqlen_q


def _key_query_range(j, seqlen_q, seqlen_k, causal):
    """Key ``j`` is seen by exactly the queries ``[begin, end)``: the suffix :func:`query_range` gives for a tile of
    one key, or an empty range (``begin == end``) for a key past ``seqlen_k``.

    Query ``i`` sees key ``j`` iff ``j < row_key_end(i)``, which holds for every ``i`` from the first such row on.
    """
    if j >= seqlen_k:
        return seqlen_q, seqlen_q
    return _query_range(j, 1, seqlen_q, seqlen_k, causal)


def _key_columns(j, col0, n_cols, seqlen_q, seqlen_k, causal):
    """:func:`key_query_range` in a tile whose column ``c`` is query ``col0 + c`` (``0 <= c < n_cols``): key ``j``
    is seen by exactly the columns ``[lo, hi)``, both clamped to ``[0, n_cols]`` (so that a kernel may compare
    them with its column numbers in 32 bits)."""
    begin, end = _key_query_range(j, seqlen_q, seqlen_k, causal)
    return min(max(begin - col0, 0), n_cols), min(max(end - col0, 0), n_cols)


def _tile_needs_mask(q_start, k_start, block_m, block_n, seqlen_q, seqlen_k, causal):
    """True if some element of the tile is invisible: a ragged end, or the causal diagonal.

    Rows past ``seqlen_q`` count as invisible too; the tile's first row has the
    shortest visible prefix, so it decides the rest.
    """
    if q_start + block_m > seqlen_q:
        return True
    return _row_key_end(q_start, seqlen_q, seqlen_k, causal) < k_start + block_n


def _first_masked_tile(q_start, block_m, block_n, seqlen_q, seqlen_k, causal):
    """The first key tile (``k_start = tile · block_n``) of the query tile at ``q_start`` that needs a mask; every
    later one needs one too, every earlier one does not (:func:`tile_needs_mask`).

    With its first row's visible prefix ``[0, end)``, a tile needs a mask iff
    ``tile · block_n + block_n > end``, i.e. ``tile >= end // block_n``; a
    query tile with rows past ``seqlen_q`` masks every key tile.
    """
    if q_start + block_m > seqlen_q:
        return 0
    return _row_key_end(q_start, seqlen_q, seqlen_k, causal) // block_n


# Host versions (plain Python) ...
row_key_end = _row_key_end
key_range = _key_range
query_range = _query_range
key_query_range = _key_query_range
key_columns = _key_columns
tile_needs_mask = _tile_needs_mask
first_masked_tile = _first_masked_tile


# ... and the same source compiled for kernels, each calling the device
# version of ``_row_key_end``.
def _for_device(fn, namespace):
    env = dict(globals())
    env.update(namespace)
    return device_function(types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__))


d_row_key_end = device_function(_row_key_end)
_DEVICE_NAMES = {"_row_key_end": d_row_key_end}
d_key_range = _for_device(_key_range, _DEVICE_NAMES)
d_query_range = _for_device(_query_range, _DEVICE_NAMES)
d_key_query_range = _for_device(_key_query_range, {"_query_range": d_query_range})
d_key_columns = _for_device(_key_columns, {"_key_query_range": d_key_query_range})
d_tile_needs_mask = _for_device(_tile_needs_mask, _DEVICE_NAMES)
d_first_masked_tile = _for_device(_first_masked_tile, _DEVICE_NAMES)
