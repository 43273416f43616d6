"""Compressed attention (NSA branch `cmp`, spec step 5) as Pallas Triton kernels.

Query `t` attends compressed block `i` iff `i*d + l - 1 <= t` (the block's last token exists).
Flash-attention style: a program holds a tile of queries and loops over tiles of compressed keys
with an online softmax in float32, so no `[T, T/d]` array is ever written to HBM. The forward also
returns the per-head log-sum-exp, which `select_blocks` uses to recompute the probabilities.

GQA layout: one program per (batch, query tile, KV group) holds the `h` query heads of that group
for `q_tile` consecutive queries, i.e. `q_tile * h` rows that all share one K/V stream. Compressed
keys are few (`T/d`) and each is read by every query after it, so sharing each K/V tile among the
`h` heads cuts K/V traffic by `h` (16 with the paper's H 64 / G 4) against a program per head, and
it makes the rows of a `tl.dot` at least 16 even when `h * q_tile` queries are few. `h` is padded to
a power of two in registers only (masked loads), never in HBM. This layout's helpers live in
`_compressed_tiles`, which `select_blocks` shares.

Rows with no admissible block (`t < l - 1`) give `o = 0`, `lse = -inf` and zero gradients.

Head dims: a d_k that is the sum of two powers of two >= 64 (the paper's 192 = 128 + 64) enters
the products as two column parts, read from q and written to dq at its own width; other head
dims are padded to a power of two >= 32 (`BlockSizes.split_dk`, `_common.key_parts`).

Layout: BTHD. `q [B, T, H, d_k]`, `k_cmp [B, C, G, d_k]`, `v_cmp [B, C, G, d_v]`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (LN_2, LOG2_E, MIN_PART, check_implementation,
                                    check_kernel_dtype, check_tile_sizes, dot, dot_parts,
                                    key_parts, load_cols, matmul_dim, next_pow2, pad_axis,
                                    pallas_call, parts_width, store_cols)
from pallas_kernels._compressed_tiles import (Tiling, admissible, blocks_visible_to, check_inputs,
                                              group_view, kv_spec, load_row_parts,
                                              load_row_stats, load_rows, pad_rows,
                                              reference_mask, row_positions, row_spec,
                                              store_row_parts, store_rows)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16). A call with `block_sizes=None` takes those of its GPU
    architecture, dtype and head dims (`pallas_kernels.profiles`).

    `block_q*` count the rows of a query tile: queries times the `h` heads of one KV group (`h`
    padded to a power of two), so a tile holds `max(1, block_q // h_pad)` queries. `block_kv*`
    count compressed keys. `_dq` / `_dkv` are the two backward kernels.
    """

    # Defaults (sm90's tiles): the fastest of a small sweep on an H200 at T = 16k, H 64, G 4,
    # d 128, bf16 (bench/bench_compressed.py --sweep).
    block_q: int = 256
    block_kv: int = 64
    block_q_dq: int = 128
    block_kv_dq: int = 64
    block_q_dkv: int = 128
    block_kv_dkv: int = 64
    num_warps: int = 8      # forward
    num_warps_bwd: int = 8  # both backward kernels
    num_stages: int = 2
    # The dK/dV kernel has one program per compressed-key tile, too few to fill a GPU (T / (d *
    # block_kv_dkv) * G). Each tile's query range is split into parts until about this many
    # programs exist; their float32 partial sums are added in XLA (deterministic, no atomics).
    dkv_programs: int = 1024
    # dK/dV from `q k^T` with transposed-operand products (default), or from transposed scores
    # `k q^T` with plain `a @ b` products. The default gave a wrong bf16 dK on an H200 at d_k 16
    # before head dims were padded to >= 32; with the padding it passes the GPU tests, and the
    # transposed form cost 36.6 ms more of the 64k forward+backward on an H100 (bench/RESULTS.md).
    dkv_transposed: bool = False
    # A d_k that is the sum of two powers of two >= 64 (192 = 128 + 64) enters the products as
    # two column parts, so q, its gradient and the keys are neither copied into arrays padded
    # to the next power of two nor read at that width (`_common.key_parts`); False pads them.
    split_dk: bool = True

    def __post_init__(self):
        check_tile_sizes(self)


# float32 operands take twice the shared memory per tile: smaller key tiles and no
# software pipelining (the 16-bit defaults asked for up to 353 KiB of the H200's 227 KiB at d 128).
# sm90's float32 tiles (`profiles`).
FLOAT32_BLOCK_SIZES = BlockSizes(block_kv=32, block_kv_dq=32, block_kv_dkv=32, num_stages=1)


def n_tiles_of(count, block: int):
    """Tiles of `block` compressed blocks that hold the first `count` blocks: ceil(count/block)."""
    return lax.div(count + (block - 1), jnp.int32(block))


# ----------------------------------------------------------------------------------------------
# Forward kernel


def _fwd_kernel(q_ref, k_ref, *refs, tiling: Tiling, cmp_block: int, cmp_stride: int,
                scale: float, block_kv: int, lse_only: bool):
    """o and lse of a query tile; with `lse_only` (refs = lse_ref) only the log-sum-exp: no V
    loads and no `p @ v` product, half the work (what selection needs when no forward ran)."""
    if lse_only:
        (lse_ref,) = refs
        v_ref = o_ref = None
    else:
        v_ref, o_ref, lse_ref = refs
    q_tile = q_ref.shape[0]
    first_query = pl.program_id(1) * q_tile
    q = load_row_parts(q_ref, first_query, tiling)
    position, real = row_positions(first_query, q_tile, tiling)
    n_rows = q[0].shape[0]
    geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride)

    def body(tile, carry, masked: bool):
        acc, row_max, row_sum = carry
        first_block = tile * block_kv
        k = load_cols(k_ref, (pl.ds(first_block, block_kv),), tiling.k_parts)
        # Scores in base 2 (exp2 is the cheap exponential on the GPU).
        s = dot_parts(q, k) * (scale * LOG2_E)
        if masked:
            s = jnp.where(admissible(position, real, first_block, block_kv, **geometry), s,
                          -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(axis=1))
        if masked:
            # A row that has seen no admissible block yet keeps max -inf; shift it by 0 instead
            # so that exp2 gives 0, not NaN.
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        else:
            shift = new_max
        rescale = jnp.exp2(row_max - shift)
        p = jnp.exp2(s - shift[:, None])
        row_sum = row_sum * rescale + p.sum(axis=1)
        if not lse_only:
            v = v_ref[pl.ds(first_block, block_kv), :]
            acc = acc * rescale[:, None] + dot(p.astype(v.dtype), v)
        return acc, new_max, row_sum

    # Bulk: the tiles every row of the program sees whole (the first query sees them), with no
    # mask; then the one or two tiles that cross some row's last admissible block, masked.
    n_bulk = lax.div(blocks_visible_to(first_query, **geometry), jnp.int32(block_kv))
    n_tiles = n_tiles_of(blocks_visible_to(first_query + q_tile - 1, **geometry), block_kv)
    acc0 = (jnp.zeros((), jnp.float32) if lse_only
            else jnp.zeros((n_rows, v_ref.shape[1]), jnp.float32))
    init = (acc0,
            jnp.full((n_rows,), -jnp.inf, jnp.float32), jnp.zeros((n_rows,), jnp.float32))
    carry = lax.fori_loop(0, n_bulk, functools.partial(body, masked=False), init)
    acc, row_max, row_sum = lax.fori_loop(n_bulk, n_tiles, functools.partial(body, masked=True),
                                          carry)

    empty = row_sum == 0.0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    if not lse_only:
        store_rows(o_ref, acc / safe_sum[:, None], tiling, tiling.d_v)
    lse = jnp.where(empty, -jnp.inf, row_max * LN_2 + jnp.log(safe_sum))
    store_rows(lse_ref, lse, tiling, None)


# ----------------------------------------------------------------------------------------------
# Backward kernels


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, tiling: Tiling,
               cmp_block: int, cmp_stride: int, scale: float, block_kv: int):
    q_tile = q_ref.shape[0]
    first_query = pl.program_id(1) * q_tile
    q = load_row_parts(q_ref, first_query, tiling)
    do = load_rows(do_ref, first_query, tiling, tiling.d_v)
    lse2 = load_row_stats(lse_ref, tiling) * LOG2_E
    delta = load_row_stats(delta_ref, tiling)
    position, real = row_positions(first_query, q_tile, tiling)
    geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride)

    def body(tile, dq, masked: bool):
        first_block = tile * block_kv
        k = load_cols(k_ref, (pl.ds(first_block, block_kv),), tiling.k_parts)
        v = v_ref[pl.ds(first_block, block_kv), :]
        s2 = dot_parts(q, k) * (scale * LOG2_E)
        # Padded rows carry lse = +inf, so p = 0 there without a mask.
        p = jnp.exp2(s2 - lse2[:, None])
        if masked:
            # Masked entries (all of them in a row with lse = -inf) are 0, never exp2(+inf).
            p = jnp.where(admissible(position, real, first_block, block_kv, **geometry), p, 0.0)
        ds = (p * (dot(do, v, trans_b=True) - delta[:, None])).astype(v.dtype)
        return [acc + dot(ds, k_part) for acc, k_part in zip(dq, k)]

    n_bulk = lax.div(blocks_visible_to(first_query, **geometry), jnp.int32(block_kv))
    n_tiles = n_tiles_of(blocks_visible_to(first_query + q_tile - 1, **geometry), block_kv)
    dq = lax.fori_loop(0, n_bulk, functools.partial(body, masked=False),
                       [jnp.zeros((do.shape[0], w), jnp.float32) for _, w in tiling.k_parts])
    dq = lax.fori_loop(n_bulk, n_tiles, functools.partial(body, masked=True), dq)
    store_row_parts(dq_ref, [x * scale for x in dq], tiling)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                tiling: Tiling, cmp_block: int, cmp_stride: int, scale: float, q_tile: int,
                n_q_tiles: int, q_tiles_per_part: int, n_parts: int, transposed: bool):
    # Each program owns one tile of compressed keys and one part of the query tiles, and writes
    # that part's dK and dV partial sums once, without atomics: deterministic.
    block_kv = k_ref.shape[0]
    part = lax.rem(pl.program_id(0), jnp.int32(n_parts))
    first_block = pl.program_id(1) * block_kv
    parts = tiling.k_parts
    k = load_cols(k_ref, (), parts)
    v = v_ref[...]
    geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride)

    def body(q_index, carry, masked: bool):
        dk, dv = carry
        first_query = q_index * q_tile
        rows = pl.ds(first_query, q_tile)
        q = load_row_parts(q_ref, first_query, tiling, rows=rows)
        do = load_rows(do_ref.at[rows], first_query, tiling, tiling.d_v)
        # Padded rows carry lse = +inf, so p = 0 there without a mask.
        lse2 = load_row_stats(lse_ref.at[rows], tiling) * LOG2_E
        delta = load_row_stats(delta_ref.at[rows], tiling)
        position, real = row_positions(first_query, q_tile, tiling)
        if transposed:
            # Transposed scores [block_kv, rows], so that both products below are plain `a @ b`.
            s2_t = dot_parts(k, q) * (scale * LOG2_E)
            p_t = jnp.exp2(s2_t - lse2[None, :])
            if masked:
                p_t = jnp.where(admissible(position, real, first_block, block_kv, **geometry,
                                           transposed=True), p_t, 0.0)
            dv = dv + dot(p_t.astype(do.dtype), do)
            ds_t = (p_t * (dot(v, do, trans_b=True) - delta[None, :])).astype(do.dtype)
            dk = [acc + dot(ds_t, q_part) for acc, q_part in zip(dk, q)]
        else:
            s2 = dot_parts(q, k) * (scale * LOG2_E)
            p = jnp.exp2(s2 - lse2[:, None])
            if masked:
                p = jnp.where(admissible(position, real, first_block, block_kv, **geometry), p,
                              0.0)
            dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
            ds = (p * (dot(do, v, trans_b=True) - delta[:, None])).astype(do.dtype)
            dk = [acc + dot(ds, q_part, trans_a=True) for acc, q_part in zip(dk, q)]
        return dk, dv

    # The first query that sees block `first_block` is t = first_block*d + l - 1; from the query
    # tile whose first query sees the tile's last block on, no row needs a mask.
    first_q_tile = lax.div(first_block * cmp_stride + cmp_block - 1, jnp.int32(q_tile))
    last_block_seen_at = (first_block + block_kv - 1) * cmp_stride + cmp_block - 1
    first_full_q_tile = lax.div(last_block_seen_at + q_tile - 1, jnp.int32(q_tile))
    start = jnp.maximum(first_q_tile, part * q_tiles_per_part)
    stop = jnp.minimum(n_q_tiles, (part + 1) * q_tiles_per_part)
    start = jnp.minimum(start, stop)
    split = jnp.clip(first_full_q_tile, start, stop)
    init = ([jnp.zeros((block_kv, w), jnp.float32) for _, w in parts],
            jnp.zeros(v.shape, jnp.float32))
    carry = lax.fori_loop(start, split, functools.partial(body, masked=True), init)
    dk, dv = lax.fori_loop(split, stop, functools.partial(body, masked=False), carry)
    store_cols(dk_ref, [x * scale for x in dk], parts)
    dv_ref[...] = dv


# ----------------------------------------------------------------------------------------------
# Wrappers


# Split d_k only where its narrow part has 64 columns or more: 192 = 128 + 64 takes less shared
# memory and spills less than 256 on sm80 to sm90, while 96 = 64 + 32 spilled 1.7 KB (sm89) to
# 8.6 KB (sm80) in the dK/dV kernel (scripts/pallas_ptxas.py), so 96 stays padded to 128.
_NARROWEST_PART = 64


def key_width(d_k: int, split_dk: bool = True) -> int:
    """The columns of q and k the kernels read: d_k where it splits into parts (192), else d_k
    padded to a power of two >= 32. The architecture profiles pick tiles by it."""
    return parts_width(key_parts(d_k, split_dk, narrowest=_NARROWEST_PART))


def _tiling(q, k_cmp, v_cmp, split_dk: bool = True) -> Tiling:
    heads = q.shape[2] // k_cmp.shape[2]
    parts = key_parts(q.shape[3], split_dk, narrowest=_NARROWEST_PART)
    return Tiling(seq_len=q.shape[1], n_cmp=k_cmp.shape[1], heads=heads, h_pad=next_pow2(heads),
                  d_k=q.shape[3], d_v=v_cmp.shape[3], dk_pad=parts_width(parts),
                  dv_pad=max(MIN_PART, matmul_dim(v_cmp.shape[3])),
                  itemsize=jnp.dtype(q.dtype).itemsize, dk_parts=parts)


def _pad_kv(x, n_blocks: int, dim_pad: int):
    """[B, C, G, D] -> [B, n_blocks, G, dim_pad], zero padded (compressed keys are few: cheap)."""
    return pad_axis(pad_axis(x, 1, n_blocks), 3, dim_pad)


def _forward(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret,
             lse_only: bool = False):
    """(o, lse); with `lse_only` (v_cmp may be None) just lse."""
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    tiling = _tiling(q, k_cmp, k_cmp if v_cmp is None else v_cmp, block_sizes.split_dk)
    q_tile = tiling.q_tile(block_sizes.block_q)
    block_kv = block_sizes.block_kv
    n_q_tiles = pl.cdiv(T, q_tile)
    T_pad = n_q_tiles * q_tile
    n_kv = pl.cdiv(tiling.n_cmp, block_kv) * block_kv
    q5 = pad_rows(group_view(q, G), T_pad, tiling, tiling.dk_pad)
    kernel = functools.partial(_fwd_kernel, tiling=tiling, cmp_block=cmp_block,
                               cmp_stride=cmp_stride, scale=scale, block_kv=block_kv,
                               lse_only=lse_only)
    lse_spec = row_spec(q_tile, tiling, None)
    lse_shape = jax.ShapeDtypeStruct((B, T_pad, G, tiling.h_pad), jnp.float32)
    inputs = [q5, _pad_kv(k_cmp, n_kv, tiling.dk_pad)]
    in_specs = [row_spec(q_tile, tiling, tiling.dk_pad), kv_spec(n_kv, tiling.dk_pad)]
    if lse_only:
        out_specs, out_shape = [lse_spec], [lse_shape]
    else:
        inputs.append(_pad_kv(v_cmp, n_kv, tiling.dv_pad))
        in_specs.append(kv_spec(n_kv, tiling.dv_pad))
        out_specs = [row_spec(q_tile, tiling, tiling.dv_pad), lse_spec]
        out_shape = [jax.ShapeDtypeStruct((B, T_pad, G, tiling.h_pad, tiling.dv_pad), q.dtype),
                     lse_shape]
    outs = pallas_call(
        kernel,
        name="nsa_compressed_lse" if lse_only else "nsa_compressed_attention_fwd",
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        interpret=interpret,
        grid=(B, n_q_tiles, G),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
    )(*inputs)
    lse = outs[-1][:, :T, :, :tiling.heads].reshape(B, T, H)
    if lse_only:
        return lse
    o = outs[0][:, :T, :, :tiling.heads, :tiling.d_v]
    return o.reshape(B, T, H, tiling.d_v), lse


def _backward(q, k_cmp, v_cmp, o, lse, do, dlse, cmp_block, cmp_stride, scale, block_sizes,
              interpret):
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    tiling = _tiling(q, k_cmp, v_cmp, block_sizes.split_dk)
    # d lse / d s = p, so an lse cotangent enters exactly like -delta.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = delta - dlse.astype(jnp.float32)

    q_tile_dq = tiling.q_tile(block_sizes.block_q_dq)
    q_tile_dkv = tiling.q_tile(block_sizes.block_q_dkv)
    T_pad = pl.cdiv(T, max(q_tile_dq, q_tile_dkv)) * max(q_tile_dq, q_tile_dkv)
    block_kv_dq, block_kv_dkv = block_sizes.block_kv_dq, block_sizes.block_kv_dkv
    n_kv = pl.cdiv(tiling.n_cmp, max(block_kv_dq, block_kv_dkv)) * max(block_kv_dq, block_kv_dkv)

    q5 = pad_rows(group_view(q, G), T_pad, tiling, tiling.dk_pad)
    do5 = pad_rows(group_view(do, G), T_pad, tiling, tiling.dv_pad)
    # +inf: padded rows get p = exp2(s - inf) = 0 in the kernels' unmasked tiles.
    lse4 = pad_rows(group_view(lse, G), T_pad, tiling, None, value=jnp.inf)
    delta4 = pad_rows(group_view(delta, G), T_pad, tiling, None)
    k_pad = _pad_kv(k_cmp, n_kv, tiling.dk_pad)
    v_pad = _pad_kv(v_cmp, n_kv, tiling.dv_pad)
    geometry = dict(tiling=tiling, cmp_block=cmp_block, cmp_stride=cmp_stride, scale=scale)
    launch = dict(num_warps=block_sizes.num_warps_bwd, num_stages=block_sizes.num_stages,
                  interpret=interpret)

    dq = pallas_call(
        functools.partial(_dq_kernel, block_kv=block_kv_dq, **geometry),
        name="nsa_compressed_attention_dq",
        **launch,
        grid=(B, T_pad // q_tile_dq, G),
        in_specs=[row_spec(q_tile_dq, tiling, tiling.dk_pad), kv_spec(n_kv, tiling.dk_pad),
                  kv_spec(n_kv, tiling.dv_pad), row_spec(q_tile_dq, tiling, tiling.dv_pad),
                  row_spec(q_tile_dq, tiling, None), row_spec(q_tile_dq, tiling, None)],
        out_specs=row_spec(q_tile_dq, tiling, tiling.dk_pad),
        out_shape=jax.ShapeDtypeStruct((B, T_pad, G, tiling.h_pad, tiling.dk_pad), q.dtype),
    )(q5, k_pad, v_pad, do5, lse4, delta4)

    n_kv_tiles = pl.cdiv(tiling.n_cmp, block_kv_dkv)
    n_q_tiles = T_pad // q_tile_dkv
    n_parts = max(1, min(n_q_tiles, pl.cdiv(block_sizes.dkv_programs, B * n_kv_tiles * G)))
    q_tiles_per_part = pl.cdiv(n_q_tiles, n_parts)
    n_parts = pl.cdiv(n_q_tiles, q_tiles_per_part)
    # Grid axis 0 enumerates (batch, part): Triton grids have three axes.
    seq_spec = lambda dim_pad: pl.BlockSpec(
        (None, T_pad, None, tiling.h_pad) + ((dim_pad,) if dim_pad else ()),
        lambda bp, j, g: (lax.div(bp, jnp.int32(n_parts)), 0, g, 0) + ((0,) if dim_pad else ()))
    kv_tile_spec = lambda dim_pad: pl.BlockSpec(
        (None, block_kv_dkv, None, dim_pad), lambda bp, j, g: (lax.div(bp, jnp.int32(n_parts)), j, g, 0))
    partial_spec = lambda dim_pad: pl.BlockSpec(
        (None, None, block_kv_dkv, None, dim_pad),
        lambda bp, j, g: (lax.rem(bp, jnp.int32(n_parts)), lax.div(bp, jnp.int32(n_parts)), j, g, 0))
    dk_parts, dv_parts = pallas_call(
        functools.partial(_dkv_kernel, q_tile=q_tile_dkv, n_q_tiles=n_q_tiles,
                          q_tiles_per_part=q_tiles_per_part, n_parts=n_parts,
                          transposed=block_sizes.dkv_transposed, **geometry),
        name="nsa_compressed_attention_dkv",
        **launch,
        grid=(B * n_parts, n_kv_tiles, G),
        in_specs=[seq_spec(tiling.dk_pad), kv_tile_spec(tiling.dk_pad),
                  kv_tile_spec(tiling.dv_pad), seq_spec(tiling.dv_pad), seq_spec(None),
                  seq_spec(None)],
        out_specs=[partial_spec(tiling.dk_pad), partial_spec(tiling.dv_pad)],
        out_shape=[jax.ShapeDtypeStruct((n_parts, B, n_kv, G, tiling.dk_pad), jnp.float32),
                   jax.ShapeDtypeStruct((n_parts, B, n_kv, G, tiling.dv_pad), jnp.float32)],
    )(q5, k_pad, v_pad, do5, lse4, delta4)
    dk = dk_parts.sum(axis=0) if n_parts > 1 else dk_parts[0]
    dv = dv_parts.sum(axis=0) if n_parts > 1 else dv_parts[0]

    C = tiling.n_cmp
    return (dq[:, :T, :, :tiling.heads, :tiling.d_k].reshape(q.shape),
            dk[:, :C, :, :tiling.d_k].astype(k_cmp.dtype),
            dv[:, :C, :, :tiling.d_v].astype(v_cmp.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _compressed_attention(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret):
    return _forward(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret)


def _compressed_attention_fwd(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes,
                              interpret):
    o, lse = _forward(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret)
    return (o, lse), (q, k_cmp, v_cmp, o, lse)


def _compressed_attention_bwd(cmp_block, cmp_stride, scale, block_sizes, interpret, residuals,
                              cotangents):
    q, k_cmp, v_cmp, o, lse = residuals
    do, dlse = cotangents
    return _backward(q, k_cmp, v_cmp, o, lse, do, dlse, cmp_block, cmp_stride, scale,
                     block_sizes, interpret)


_compressed_attention.defvjp(_compressed_attention_fwd, _compressed_attention_bwd)
# Jitted so that eager callers compile each shape once (the padding and reshapes around the
# kernels fuse into the same executable).
_compressed_attention_jit = jax.jit(_compressed_attention, static_argnums=(3, 4, 5, 6, 7))


def compressed_attention(q, k_cmp, v_cmp, *, cmp_block: int, cmp_stride: int,
                         scale: Optional[float] = None,
                         block_sizes: Optional[BlockSizes] = None, interpret: bool = False,
                         implementation: str = "triton"):
    """Compressed attention with the spec's mask, as Pallas Triton kernels (forward and backward).

    Args:
      q: `[B, T, H, d_k]`, queries at positions `0..T-1`.
      k_cmp: `[B, C, G, d_k]`, compressed keys (block `i` covers tokens `[i*d, i*d + l)`).
      v_cmp: `[B, C, G, d_v]`, compressed values.
      cmp_block: l. cmp_stride: d. scale: softmax scale, `1/sqrt(d_k)` when None.
      block_sizes: tiles (None: this GPU architecture's, `pallas_kernels.profiles`).
        interpret: run the kernels in Pallas' interpreter (CPU tests).
      implementation: "triton" (the Pallas Triton kernels) or "xla" (the reference below).

    Raises NotImplementedError for inputs outside `_common.KERNEL_DTYPES` (float64) with
    "triton", and for head dims the architecture has no tiles for (`profiles`).

    Returns:
      `o [B, T, H, d_v]` in the dtype of `q` and `lse [B, T, H]` float32 (natural log), with
      `o = 0`, `lse = -inf` where query `t` sees no block (`t < l - 1`, or `C = 0`).
      Differentiable in `q`, `k_cmp`, `v_cmp` (through `o` and `lse`).
    """
    check_implementation(implementation)
    scale = check_inputs(q, k_cmp, v_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride,
                         scale=scale)
    if implementation == "triton":
        check_kernel_dtype("compressed_attention", q.dtype)
        block_sizes = _default_block_sizes(q, block_sizes, v_cmp.shape[3])
    B, T, H, _ = q.shape
    if k_cmp.shape[1] == 0 or B == 0:
        # No compressed block exists yet (T < l), or no sequence: nothing to compute (and no
        # grid to launch). o does not depend on the inputs, so every gradient is exactly zero.
        o = jnp.zeros((B, T, H, v_cmp.shape[3]), q.dtype)
        return o, jnp.full((B, T, H), -jnp.inf, jnp.float32)
    if implementation == "xla":
        return compressed_attention_reference(q, k_cmp, v_cmp, cmp_block=cmp_block,
                                              cmp_stride=cmp_stride, scale=scale)
    return _compressed_attention_jit(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, block_sizes,
                                     interpret)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _compressed_lse_jit(q, k_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret):
    return _forward(q, k_cmp, None, cmp_block, cmp_stride, scale, block_sizes, interpret,
                    lse_only=True)


def _default_block_sizes(q, block_sizes: Optional[BlockSizes],
                         d_v: Optional[int]) -> BlockSizes:
    """`block_sizes`, or the tiles of this GPU architecture, dtype and head dims (d_v None: the
    lse-only forward, which reads no values; float32
    operands take twice the shared memory of 16-bit ones: smaller key tiles, no software
    pipelining). NotImplementedError where the architecture has no tiles for the heads."""
    if block_sizes is None:
        from pallas_kernels import profiles
        return profiles.block_sizes("compressed", q.dtype, q.shape[3], d_v)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a compressed_attention.BlockSizes, got "
                         f"{type(block_sizes).__name__}")
    return block_sizes


def compressed_lse(q, k_cmp, *, cmp_block: int, cmp_stride: int, scale: Optional[float] = None,
                   block_sizes: Optional[BlockSizes] = None, interpret: bool = False,
                   implementation: str = "triton"):
    """The `lse [B, T, H]` (float32) of `compressed_attention` alone: the forward kernel without
    values or output (half its work). For `select_blocks` when no compressed forward ran.
    No gradient. Arguments as `compressed_attention`'s."""
    check_implementation(implementation)
    scale = check_inputs(q, k_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride, scale=scale)
    if implementation == "triton":
        check_kernel_dtype("compressed_attention", q.dtype)
        block_sizes = _default_block_sizes(q, block_sizes, None)
    B, T, H, _ = q.shape
    if k_cmp.shape[1] == 0 or B == 0:
        return jnp.full((B, T, H), -jnp.inf, jnp.float32)
    q, k_cmp = lax.stop_gradient(q), lax.stop_gradient(k_cmp)
    if implementation == "xla":
        # The values do not enter lse: the keys stand in for them (XLA drops the unused o).
        return compressed_attention_reference(q, k_cmp, k_cmp, cmp_block=cmp_block,
                                              cmp_stride=cmp_stride, scale=scale)[1]
    return _compressed_lse_jit(q, k_cmp, cmp_block, cmp_stride, scale, block_sizes, interpret)


# ----------------------------------------------------------------------------------------------
# Plain-JAX reference


def compressed_attention_reference(q, k_cmp, v_cmp, *, cmp_block: int, cmp_stride: int,
                                   scale: Optional[float] = None, q_offset: int = 0):
    """Plain-jnp compressed attention with an explicit `[T, C]` mask, in float32.

    Same contract as `compressed_attention`; `q_offset` places the queries at positions
    `q_offset .. q_offset + T - 1` (to evaluate a long sequence a chunk of queries at a time).
    Memory O(B T H C): for tests and chunked checks only.
    """
    scale = check_inputs(q, k_cmp, v_cmp, cmp_block=cmp_block, cmp_stride=cmp_stride,
                         scale=scale)
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    qg = group_view(q, G).astype(jnp.float32)
    s = jnp.einsum("btghd,bcgd->btghc", qg, k_cmp.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    mask = reference_mask(T, k_cmp.shape[1], cmp_block, cmp_stride, q_offset)[None, :, None,
                                                                                  None, :]
    row_max = lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    # Masked scores are replaced before exp so that no inf ever enters a gradient.
    e = jnp.where(mask, jnp.exp(jnp.where(mask, s, row_max) - row_max), 0.0)
    row_sum = e.sum(axis=-1, keepdims=True)
    empty = row_sum == 0.0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    o = jnp.einsum("btghc,bcgd->btghd", e / safe_sum, v_cmp.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(safe_sum))[..., 0]
    return o.reshape(B, T, H, -1).astype(q.dtype), lse.reshape(B, T, H)
