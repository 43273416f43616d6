"""Sliding-window attention (NSA branch `win`, spec step 8) as Pallas Triton kernels.

Query `t` attends keys `s` with `t - w < s <= t`, i.e. `max(0, t - w + 1) .. t` (w keys, itself
included; docs/NSA_SPEC.md). Flash-attention style: a program holds a tile of queries and walks
only the key tiles that meet its window, with an online softmax in float32, so the work is
O(T * w) and no `[T, T]` array exists. The forward also returns the per-head log-sum-exp
(natural log, as the other branches' kernels).

GQA layout, as the compressed-attention kernels: one program per (batch, query tile, KV group)
holds the `h` query heads of that group for `q_tile` consecutive queries, `q_tile * h_pad` rows
that share one K/V stream (`h` padded to a power of two). A window's keys are read once per
group instead of once per head, and a tile of few queries (8 at the paper's h = 16) spans a band
of `w + q_tile` keys, so the key tiles that need a mask are the one or two at each end.

Head dims: `d_k` enters the products in its column parts (`_common.column_parts`: 192 =
128 + 64 unpadded), so the paper's q and k are read in place; `d_v` is padded to a power of two
>= 32 (the paper's 128: no copy). T is padded to whole tiles (no copy at multiples of 128), and
`h` to a power of two. Packed sequences are not supported (the backend falls through to XLA).

Layout: BTHD. `q [B, T, H, d_k]`, `k [B, T, G, d_k]`, `v [B, T, G, d_v]`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (LN_2, LOG2_E, MASK, MIN_PART, check_implementation,
                                    check_kernel_dtype, check_tile_sizes, dot, dot_parts,
                                    key_parts, load_cols, load_head_rows, matmul_dim, next_pow2,
                                    online_softmax_finish, online_softmax_init,
                                    online_softmax_step, pad_axis, pallas_call, parts_width,
                                    softmax_scale, store_cols, store_head_rows)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16). A call with `block_sizes=None` takes those of its GPU
    architecture, dtype and head dims (`pallas_kernels.profiles`).

    `block_q*` count the rows of a query tile: queries times the `h` heads of one KV group (`h`
    padded to a power of two), so a tile holds `max(1, block_q // h_pad)` queries. `block_kv*`
    count keys. `_dq` / `_dkv` are the two backward kernels.
    """

    # sm90's tiles; not yet timed on a GPU.
    block_q: int = 128
    block_kv: int = 64
    block_q_dq: int = 128
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_warps: int = 8      # forward
    num_warps_bwd: int = 8  # both backward kernels
    num_stages: int = 2
    # dK/dV from `q k^T` with transposed-operand products (False), or from transposed scores
    # `k q^T` with plain `a @ b` products (True), which spill less without wgmma (sm80 / sm89).
    dkv_transposed: bool = False

    def __post_init__(self):
        check_tile_sizes(self)


# float32 operands take twice the shared memory per tile, and their IEEE products run on the
# FMA units with the tiles in registers: half the rows and keys, no pipelining (sm90's tiles).
FLOAT32_BLOCK_SIZES = BlockSizes(block_q=64, block_kv=32, block_q_dq=64, block_kv_dq=32,
                                 block_q_dkv=32, block_kv_dkv=32, num_stages=1)



@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static facts of one call, shared by the kernels."""

    T: int            # queries = keys
    heads: int        # h, query heads per KV group
    d_k: int
    d_v: int
    window: int       # w, at most T (a longer window is the causal mask)

    @property
    def h_pad(self) -> int:
        return next_pow2(self.heads)

    @property
    def dk_parts(self) -> tuple:
        """(offset, width) column parts of q and k in the products, none narrower than 32."""
        return key_parts(self.d_k)

    @property
    def dk_width(self) -> int:
        """The width q and k are read at (d_k itself where its parts cover it)."""
        return parts_width(self.dk_parts)

    @property
    def dv_pad(self) -> int:
        return max(MIN_PART, matmul_dim(self.d_v))

    def q_tile(self, block_rows: int) -> int:
        """Queries of a tile of `block_rows` rows (at least one)."""
        return max(1, block_rows // self.h_pad)


def _div(a, b: int):
    """a // b for int32 scalars a >= 0 (Triton's integer division truncates)."""
    return lax.div(a, jnp.int32(b))


def _key_tiles(first_query, q_tile: int, block_kv: int, window: int):
    """Key tiles `[start, stop)` that meet the windows of queries `first_query ..
    first_query + q_tile - 1`, and within them `[bulk_start, bulk_stop)`, the tiles every one of
    those queries sees whole (no mask)."""
    last_query = first_query + q_tile - 1
    start = _div(jnp.maximum(first_query - window + 1, 0), block_kv)
    stop = _div(last_query + block_kv, block_kv)
    # Whole for every row: first key > last_query - w, last key <= first_query.
    bulk_start = jnp.clip(_div(jnp.maximum(last_query - window + 1, 0) + block_kv - 1, block_kv),
                          start, stop)
    bulk_stop = jnp.clip(_div(first_query + 1, block_kv), bulk_start, stop)
    return start, bulk_start, bulk_stop, stop


def _query_tiles(first_key, block_kv: int, q_tile: int, window: int, n_q_tiles: int):
    """Query tiles `[start, stop)` whose windows meet keys `first_key .. first_key + block_kv -
    1`, and within them `[bulk_start, bulk_stop)`, those that see all of these keys."""
    last_key = first_key + block_kv - 1
    start = _div(first_key, q_tile)
    stop = jnp.minimum(_div(last_key + window - 1, q_tile) + 1, n_q_tiles)
    # Whole for every row: first query >= last_key, last query < first_key + w.
    bulk_start = jnp.clip(_div(last_key + q_tile - 1, q_tile), start, stop)
    bulk_stop = jnp.clip(_div(first_key + window, q_tile), bulk_start, stop)
    return start, bulk_start, bulk_stop, stop


def _positions(first: int, count: int, h_pad: int):
    """Query position `[count * h_pad]` of each row of a tile (row r: query first + r // h_pad)."""
    rows = jnp.arange(count * h_pad, dtype=jnp.int32)
    return first + lax.div(rows, jnp.int32(h_pad))


def _visible(query, key, window: int):
    """The spec's window: key `s` is visible to query `t` iff `t - w < s <= t`."""
    return (key <= query) & (key > query - window)


def _row_stats(ref, first, q_tile: int):
    """`[q_tile * h_pad]` of a `[.., h_pad]` float32 ref (lse, delta)."""
    return ref[pl.ds(first, q_tile), :].reshape(q_tile * ref.shape[1])


# ----------------------------------------------------------------------------------------------
# Kernels


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, geo: _Geometry, scale: float,
                block_kv: int):
    """One (batch, query tile, KV group). q_ref [q_tile, h_pad, dk_width], k_ref [T_pad,
    dk_width], v_ref [T_pad, dv_pad]; o_ref [q_tile, h_pad, dv_pad], lse_ref [q_tile, h_pad]."""
    q_tile = q_ref.shape[0]
    first_query = pl.program_id(1) * q_tile
    parts = geo.dk_parts
    q = load_head_rows(q_ref, pl.ds(0, q_tile), parts)
    position = _positions(first_query, q_tile, geo.h_pad)

    def body(tile, carry, masked: bool):
        first_key = tile * block_kv
        k = load_cols(k_ref, (pl.ds(first_key, block_kv),), parts)
        v = v_ref[pl.ds(first_key, block_kv), :]
        s = dot_parts(q, k) * (scale * LOG2_E)               # [rows, block_kv], log2 domain
        if masked:
            key = first_key + jnp.arange(block_kv, dtype=jnp.int32)
            s = jnp.where(_visible(position[:, None], key[None, :], geo.window), s, MASK)
        return online_softmax_step(carry, s, v)

    # Every row sees its own key, so no row ends empty (padded rows read zero keys past T).
    start, bulk_start, bulk_stop, stop = _key_tiles(first_query, q_tile, block_kv, geo.window)
    carry = online_softmax_init(q[0].shape[0], v_ref.shape[1])
    carry = lax.fori_loop(start, bulk_start, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(bulk_start, bulk_stop, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(bulk_stop, stop, functools.partial(body, masked=True), carry)
    o, lse_log2 = online_softmax_finish(carry)
    o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = (lse_log2 * LN_2).reshape(lse_ref.shape)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, geo: _Geometry,
               scale: float, block_kv: int):
    """One (batch, query tile, KV group): dq of its rows. Refs as `_fwd_kernel`'s, with
    do_ref [q_tile, h_pad, dv_pad], lse_ref / delta_ref [q_tile, h_pad]; dq_ref [q_tile, h_pad,
    dk_width]."""
    q_tile = q_ref.shape[0]
    first_query = pl.program_id(1) * q_tile
    parts = geo.dk_parts
    q = load_head_rows(q_ref, pl.ds(0, q_tile), parts)
    (do,) = load_head_rows(do_ref, pl.ds(0, q_tile), ((0, do_ref.shape[2]),))
    # Padded rows carry lse = +inf: p = 0 there without a mask.
    lse2 = _row_stats(lse_ref, 0, q_tile) * LOG2_E
    delta = _row_stats(delta_ref, 0, q_tile)
    position = _positions(first_query, q_tile, geo.h_pad)

    def body(tile, dq, masked: bool):
        first_key = tile * block_kv
        k = load_cols(k_ref, (pl.ds(first_key, block_kv),), parts)
        v = v_ref[pl.ds(first_key, block_kv), :]
        p = jnp.exp2(dot_parts(q, k) * (scale * LOG2_E) - lse2[:, None])
        if masked:
            key = first_key + jnp.arange(block_kv, dtype=jnp.int32)
            p = jnp.where(_visible(position[:, None], key[None, :], geo.window), p, 0.0)
        ds = (p * (dot(do, v, trans_b=True) - delta[:, None])).astype(v.dtype)
        return [acc + dot(ds, k_part) for acc, k_part in zip(dq, k)]

    start, bulk_start, bulk_stop, stop = _key_tiles(first_query, q_tile, block_kv, geo.window)
    dq = [jnp.zeros((do.shape[0], w), jnp.float32) for _, w in parts]
    dq = lax.fori_loop(start, bulk_start, functools.partial(body, masked=True), dq)
    dq = lax.fori_loop(bulk_start, bulk_stop, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(bulk_stop, stop, functools.partial(body, masked=True), dq)
    store_head_rows(dq_ref, [x * scale for x in dq], parts)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                geo: _Geometry, scale: float, q_tile: int, n_q_tiles: int, transposed: bool):
    """One (batch, key tile, KV group): dk and dv of its keys from the query tiles whose windows
    meet them, written once (no atomics: deterministic). q_ref [T_pad, h_pad, dk_width], do_ref
    [T_pad, h_pad, dv_pad], lse_ref / delta_ref [T_pad, h_pad] (the whole sequence of the group);
    k_ref / dk_ref [block_kv, dk_width], v_ref / dv_ref [block_kv, dv_pad]."""
    block_kv = k_ref.shape[0]
    first_key = pl.program_id(1) * block_kv
    parts = geo.dk_parts
    k = load_cols(k_ref, (pl.ds(0, block_kv),), parts)
    v = v_ref[...]
    key = first_key + jnp.arange(block_kv, dtype=jnp.int32)

    def body(q_index, carry, masked: bool):
        dk, dv = carry
        first_query = q_index * q_tile
        q = load_head_rows(q_ref, pl.ds(first_query, q_tile), parts)
        (do,) = load_head_rows(do_ref, pl.ds(first_query, q_tile), ((0, do_ref.shape[2]),))
        # Padded rows carry lse = +inf: p = 0 there without a mask.
        lse2 = _row_stats(lse_ref, first_query, q_tile) * LOG2_E
        delta = _row_stats(delta_ref, first_query, q_tile)
        position = _positions(first_query, q_tile, geo.h_pad)
        if transposed:
            # Scores [block_kv, rows], so that every product below is a plain `a @ b`.
            p_t = jnp.exp2(dot_parts(k, q) * (scale * LOG2_E) - lse2[None, :])
            if masked:
                p_t = jnp.where(_visible(position[None, :], key[:, None], geo.window), p_t, 0.0)
            dv = dv + dot(p_t.astype(do.dtype), do)
            ds_t = (p_t * (dot(v, do, trans_b=True) - delta[None, :])).astype(do.dtype)
            dk = [acc + dot(ds_t, q_part) for acc, q_part in zip(dk, q)]
        else:
            p = jnp.exp2(dot_parts(q, k) * (scale * LOG2_E) - lse2[:, None])
            if masked:
                p = jnp.where(_visible(position[:, None], key[None, :], geo.window), p, 0.0)
            dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
            ds = (p * (dot(do, v, trans_b=True) - delta[:, None])).astype(do.dtype)
            dk = [acc + dot(ds, q_part, trans_a=True) for acc, q_part in zip(dk, q)]
        return dk, dv

    start, bulk_start, bulk_stop, stop = _query_tiles(first_key, block_kv, q_tile, geo.window,
                                                      n_q_tiles)
    carry = ([jnp.zeros((block_kv, w), jnp.float32) for _, w in parts],
             jnp.zeros(v.shape, jnp.float32))
    carry = lax.fori_loop(start, bulk_start, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(bulk_start, bulk_stop, functools.partial(body, masked=False), carry)
    dk, dv = lax.fori_loop(bulk_stop, stop, functools.partial(body, masked=True), carry)
    store_cols(dk_ref, [(x * scale).astype(dk_ref.dtype) for x in dk], parts)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Wrappers


def _geometry(q, k, v, window: int) -> _Geometry:
    T = q.shape[1]
    return _Geometry(T=T, heads=q.shape[2] // k.shape[2], d_k=q.shape[3], d_v=v.shape[3],
                     window=min(window, T))


def _padded_len(T: int, *tiles: int) -> int:
    """T rounded up to a whole number of the largest tile (all are powers of two), so that
    every query tile and every key tile a kernel reads lies inside the padded arrays."""
    step = max(tiles)
    return -(-T // step) * step


def _group_rows(x, G: int, T_pad: int, h_pad: int, width: Optional[int], value=0.0):
    """[B, T, H(, d)] -> [B, T_pad, G, h_pad(, width)] (a reshape where nothing is padded)."""
    x = x.reshape(x.shape[0], x.shape[1], G, x.shape[2] // G, *x.shape[3:])
    x = pad_axis(pad_axis(x, 1, T_pad, value=value), 3, h_pad, value=value)
    return x if width is None else pad_axis(x, 4, width)


def _pad_kv(x, T_pad: int, width: int):
    """[B, T, G, d] -> [B, T_pad, G, width], zero padded (no copy where nothing is padded)."""
    return pad_axis(pad_axis(x, 1, T_pad), 3, width)


def _row_spec(q_tile: int, h_pad: int, width: Optional[int]):
    """BlockSpec of a `[q_tile, h_pad(, width)]` tile of a `[B, T_pad, G, h_pad(, width)]` array
    on grid (batch, query tile, group)."""
    if width is None:
        return pl.BlockSpec((None, q_tile, None, h_pad), lambda b, i, g: (b, i, g, 0))
    return pl.BlockSpec((None, q_tile, None, h_pad, width), lambda b, i, g: (b, i, g, 0, 0))


def _seq_spec(T_pad: int, width: int):
    """BlockSpec of a whole `[T_pad, width]` sequence of one (batch, group) of `[B, T_pad, G,
    width]`."""
    return pl.BlockSpec((None, T_pad, None, width), lambda b, i, g: (b, 0, g, 0))


def _forward(q, k, v, window, scale, block_sizes, interpret):
    B, T, H, _ = q.shape
    G = k.shape[2]
    geo = _geometry(q, k, v, window)
    q_tile = geo.q_tile(block_sizes.block_q)
    block_kv = block_sizes.block_kv
    T_pad = _padded_len(T, q_tile, block_kv)
    o, lse = pallas_call(
        functools.partial(_fwd_kernel, geo=geo, scale=scale, block_kv=block_kv),
        name="nsa_window_attention_fwd",
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        interpret=interpret,
        grid=(B, T_pad // q_tile, G),
        in_specs=[_row_spec(q_tile, geo.h_pad, geo.dk_width), _seq_spec(T_pad, geo.dk_width),
                  _seq_spec(T_pad, geo.dv_pad)],
        out_specs=[_row_spec(q_tile, geo.h_pad, geo.dv_pad), _row_spec(q_tile, geo.h_pad, None)],
        out_shape=[jax.ShapeDtypeStruct((B, T_pad, G, geo.h_pad, geo.dv_pad), q.dtype),
                   jax.ShapeDtypeStruct((B, T_pad, G, geo.h_pad), jnp.float32)],
    )(_group_rows(q, G, T_pad, geo.h_pad, geo.dk_width), _pad_kv(k, T_pad, geo.dk_width),
      _pad_kv(v, T_pad, geo.dv_pad))
    o = o[:, :T, :, :geo.heads, :geo.d_v].reshape(B, T, H, geo.d_v)
    return o, lse[:, :T, :, :geo.heads].reshape(B, T, H)


def _backward(q, k, v, o, lse, do, dlse, window, scale, block_sizes, interpret):
    B, T, H, _ = q.shape
    G = k.shape[2]
    geo = _geometry(q, k, v, window)
    # d lse / d s = p, so an lse cotangent enters exactly like -delta.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = delta - dlse.astype(jnp.float32)
    q_tile_dq = geo.q_tile(block_sizes.block_q_dq)
    q_tile_dkv = geo.q_tile(block_sizes.block_q_dkv)
    block_kv_dq, block_kv_dkv = block_sizes.block_kv_dq, block_sizes.block_kv_dkv
    T_pad = _padded_len(T, q_tile_dq, q_tile_dkv, block_kv_dq, block_kv_dkv)
    dk_width, dv_pad, h_pad = geo.dk_width, geo.dv_pad, geo.h_pad

    q5 = _group_rows(q, G, T_pad, h_pad, dk_width)
    do5 = _group_rows(do, G, T_pad, h_pad, dv_pad)
    # +inf: padded rows (past T, or padded heads) get p = exp2(s - inf) = 0 in every tile.
    lse4 = _group_rows(lse, G, T_pad, h_pad, None, value=jnp.inf)
    delta4 = _group_rows(delta, G, T_pad, h_pad, None)
    k_pad, v_pad = _pad_kv(k, T_pad, dk_width), _pad_kv(v, T_pad, dv_pad)
    launch = dict(num_warps=block_sizes.num_warps_bwd, num_stages=block_sizes.num_stages,
                  interpret=interpret)

    dq = pallas_call(
        functools.partial(_dq_kernel, geo=geo, scale=scale, block_kv=block_kv_dq),
        name="nsa_window_attention_dq",
        **launch,
        grid=(B, T_pad // q_tile_dq, G),
        in_specs=[_row_spec(q_tile_dq, h_pad, dk_width), _seq_spec(T_pad, dk_width),
                  _seq_spec(T_pad, dv_pad), _row_spec(q_tile_dq, h_pad, dv_pad),
                  _row_spec(q_tile_dq, h_pad, None), _row_spec(q_tile_dq, h_pad, None)],
        out_specs=_row_spec(q_tile_dq, h_pad, dk_width),
        out_shape=jax.ShapeDtypeStruct((B, T_pad, G, h_pad, dk_width), q.dtype),
    )(q5, k_pad, v_pad, do5, lse4, delta4)

    whole = lambda width: pl.BlockSpec(  # noqa: E731 (the whole sequence of one group)
        (None, T_pad, None, h_pad) + ((width,) if width else ()),
        lambda b, j, g: (b, 0, g, 0) + ((0,) if width else ()))
    key_tile = lambda width: pl.BlockSpec((None, block_kv_dkv, None, width),  # noqa: E731
                                          lambda b, j, g: (b, j, g, 0))
    dk, dv = pallas_call(
        functools.partial(_dkv_kernel, geo=geo, scale=scale, q_tile=q_tile_dkv,
                          n_q_tiles=T_pad // q_tile_dkv, transposed=block_sizes.dkv_transposed),
        name="nsa_window_attention_dkv",
        **launch,
        grid=(B, T_pad // block_kv_dkv, G),
        in_specs=[whole(dk_width), key_tile(dk_width), key_tile(dv_pad), whole(dv_pad),
                  whole(None), whole(None)],
        out_specs=[key_tile(dk_width), key_tile(dv_pad)],
        out_shape=[jax.ShapeDtypeStruct((B, T_pad, G, dk_width), k.dtype),
                   jax.ShapeDtypeStruct((B, T_pad, G, dv_pad), v.dtype)],
    )(q5, k_pad, v_pad, do5, lse4, delta4)

    return (dq[:, :T, :, :geo.heads, :geo.d_k].reshape(q.shape),
            dk[:, :T, :, :geo.d_k], dv[:, :T, :, :geo.d_v])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _window_attention(q, k, v, window, scale, block_sizes, interpret):
    return _forward(q, k, v, window, scale, block_sizes, interpret)


def _window_attention_fwd(q, k, v, window, scale, block_sizes, interpret):
    o, lse = _forward(q, k, v, window, scale, block_sizes, interpret)
    return (o, lse), (q, k, v, o, lse)


def _window_attention_bwd(window, scale, block_sizes, interpret, residuals, cotangents):
    q, k, v, o, lse = residuals
    do, dlse = cotangents
    return _backward(q, k, v, o, lse, do, dlse, window, scale, block_sizes, interpret)


_window_attention.defvjp(_window_attention_fwd, _window_attention_bwd)
# Jitted so that eager callers compile each shape once (the reshapes around the kernels fuse
# into the same executable).
_window_attention_jit = jax.jit(_window_attention, static_argnums=(3, 4, 5, 6))


def check_inputs(q, k, v, *, window, scale=None) -> float:
    """Validate BTHD shapes and the window; return the softmax scale."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window ({window!r}) must be a positive int")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d_k], got shape {q.shape}")
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"k and v must be [B, T, G, d], got shapes {k.shape} and {v.shape}")
    B, T, H, d_k = q.shape
    G = k.shape[2]
    if k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B={B}, T={T}, G, d] to match q "
                         f"{q.shape}")
    if k.shape[3] != d_k:
        raise ValueError(f"k's head dim ({k.shape[3]}) must equal q's d_k ({d_k})")
    if G == 0 or H % G:
        raise ValueError(f"the heads of q ({H}) must be a multiple of the heads of k ({G})")
    if T == 0:
        raise ValueError("q must hold at least one query (T >= 1)")
    return softmax_scale(scale, d_k)


def _default_block_sizes(q, v, block_sizes: Optional[BlockSizes]) -> BlockSizes:
    """`block_sizes`, or the tiles of this GPU architecture, dtype and head dims (`profiles`);
    NotImplementedError where the architecture has none for the heads."""
    if block_sizes is None:
        from pallas_kernels import profiles
        return profiles.block_sizes("window", q.dtype, q.shape[3], v.shape[3])
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a window_attention.BlockSizes, got "
                         f"{type(block_sizes).__name__}")
    return block_sizes


def window_attention(q, k, v, *, window: int, scale: Optional[float] = None,
                     return_lse: bool = False, block_sizes: Optional[BlockSizes] = None,
                     interpret: bool = False, implementation: str = "triton"):
    """Sliding-window causal attention as Pallas Triton kernels (forward and backward).

    Args:
      q: `[B, T, H, d_k]`, queries at positions `0..T-1`.
      k: `[B, T, G, d_k]`, v: `[B, T, G, d_v]` (GQA: H a multiple of G; d_k, d_v up to 256).
      window: w; query `t` attends keys `max(0, t - w + 1) .. t`. A window of T or more is
        causal attention.
      scale: softmax scale, `1/sqrt(d_k)` when None.
      return_lse: also return the log-sum-exp.
      block_sizes: tiles (None: this GPU architecture's, `pallas_kernels.profiles`).
      interpret: run the kernels in Pallas' interpreter (CPU tests).
      implementation: "triton" (the Pallas Triton kernels) or "xla" (the reference below).

    Raises NotImplementedError for inputs outside `_common.KERNEL_DTYPES` (float64) with
    "triton", and for head dims the architecture has no tiles for (`profiles`).

    Returns:
      `o [B, T, H, d_v]` in the dtype of `q`; with `return_lse`, `(o, lse [B, T, H])`, lse
      float32 (natural log). Differentiable in `q`, `k`, `v` (through `o` and `lse`).
    """
    check_implementation(implementation)
    scale = check_inputs(q, k, v, window=window, scale=scale)
    if implementation == "xla":
        return window_attention_reference(q, k, v, window=window, scale=scale,
                                          return_lse=return_lse)
    check_kernel_dtype("window_attention", q.dtype)
    # Resolved here, outside the jit: its cache key then holds the architecture's tiles.
    block_sizes = _default_block_sizes(q, v, block_sizes)
    B, T, H, _ = q.shape
    if B == 0:  # no sequence: no grid to launch
        o = jnp.zeros((0, T, H, v.shape[3]), q.dtype)
        return (o, jnp.zeros((0, T, H), jnp.float32)) if return_lse else o
    o, lse = _window_attention_jit(q, k, v, window, scale, block_sizes, interpret)
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------------------------
# Plain-JAX reference


def window_attention_reference(q, k, v, *, window: int, scale: Optional[float] = None,
                               return_lse: bool = False):
    """Plain-jnp sliding-window attention with an explicit `[T, T]` mask, computed in float32
    (float64 for float64 inputs). Same contract as `window_attention`; memory O(B T H T): for
    tests only."""
    scale = check_inputs(q, k, v, window=window, scale=scale)
    B, T, H, _ = q.shape
    G = k.shape[2]
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(B, T, G, H // G, -1).astype(dtype)
    s = jnp.einsum("btghd,bsgd->btghs", qg, k.astype(dtype),
                   precision=lax.Precision.HIGHEST) * scale
    position = jnp.arange(T)
    mask = _visible(position[:, None], position[None, :], window)[None, :, None, None, :]
    # The diagonal is always visible: every row has a finite max.
    row_max = lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    e = jnp.where(mask, jnp.exp(jnp.where(mask, s, row_max) - row_max), 0.0)
    row_sum = e.sum(axis=-1, keepdims=True)
    o = jnp.einsum("btghs,bsgd->btghd", e / row_sum, v.astype(dtype),
                   precision=lax.Precision.HIGHEST)
    o = o.reshape(B, T, H, -1).astype(q.dtype)
    if not return_lse:
        return o
    return o, (row_max + jnp.log(row_sum))[..., 0].reshape(B, T, H)
