"""The tile layout shared by the kernels over compressed keys: `compressed_attention` and
`select_blocks`.

A program holds the `h` query heads of one KV group for `q_tile` consecutive queries as
`q_tile * h_pad` rows (row r: query `first_query + r // h_pad`, head `r % h_pad`; `h` padded to a
power of two in registers only, masked loads), and walks tiles of the group's compressed keys.
Here: the static shape facts of a call (`Tiling`), the row loads and stores, the spec's mask
(`i*d + l - 1 <= t`) on rows and tiles, the `BlockSpec`s and padding of the wrappers, the input
checks and the reference mask.

Layout: BTHD. `q [B, T, H, d_k]`, `k_cmp [B, C, G, d_k]`, `v_cmp [B, C, G, d_v]`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nsa_common import cmp_admissible
from pallas_kernels._common import (MATMUL_MIN, load_head_rows, next_pow2, pad_axis,
                                    softmax_scale, store_head_rows)


# 256 rows x 128 features: the largest query tile measured (H200, bench_compressed --sweep).
MAX_TILE_ELEMENTS = 256 * 128


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static shape facts of one call, shared by the kernels."""

    seq_len: int   # T
    n_cmp: int     # C
    heads: int     # h, query heads per KV group
    h_pad: int     # h as a power of two
    d_k: int
    d_v: int
    dk_pad: int
    dv_pad: int
    itemsize: int = 2  # bytes per element of q (float32 tiles take twice the shared memory)
    # (offset, width) column parts of q and k in the products (`_common.key_parts`); empty: one
    # part of `dk_pad` columns.
    dk_parts: tuple = ()

    @property
    def k_parts(self) -> tuple:
        return self.dk_parts or ((0, self.dk_pad),)

    def q_tile(self, block_rows: int) -> int:
        """Queries per tile for a tile of `block_rows` rows (at least one query). Wide heads get
        fewer rows: a tile holds at most `MAX_TILE_ELEMENTS` 16-bit query elements, the size
        the defaults were measured at, so that d_k = 192 (sized as 256, whether read in column
        parts or padded) still fits shared memory; float32 tiles hold half as many (at d 128
        the float32 backward asked for 257 KiB of the H200's 227 KiB with 16-bit-sized
        tiles)."""
        widest = max(next_pow2(self.dk_pad), next_pow2(self.dv_pad)) * max(1, self.itemsize // 2)
        block_rows = min(block_rows, max(MATMUL_MIN, MAX_TILE_ELEMENTS // widest))
        return max(1, block_rows // self.h_pad)


def load_rows(ref, first_query, tiling: Tiling, dim: int):
    """Load a `[q_tile, h_pad, dim_pad]` tile of queries x heads and flatten it to rows
    `[q_tile * h_pad, dim_pad]` (row r: query `first_query + r // h_pad`, head `r % h_pad`).
    Padded heads and padded features read as 0. The caller pads T to a whole number of tiles."""
    q_tile, h_pad, dim_pad = ref.shape
    mask = None
    if h_pad != tiling.heads:
        mask = (jnp.arange(h_pad) < tiling.heads)[None, :, None]
    if dim_pad != dim:
        dim_mask = (jnp.arange(dim_pad) < dim)[None, None, :]
        mask = dim_mask if mask is None else mask & dim_mask
    if mask is None:
        tile = ref[...]
    else:
        tile = pltriton.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)
    return tile.reshape(q_tile * h_pad, dim_pad)


def load_row_parts(ref, first_query, tiling: Tiling, rows=None) -> list:
    """q's rows as `load_rows` gives them, cut into the column parts of `tiling.k_parts`; `rows`
    (a `pl.ds` of queries, or None: the whole ref) picks the queries of a longer ref. Split
    parts read their columns of an array that `pad_rows` padded to `h_pad` heads, unmasked."""
    parts = tiling.k_parts
    if len(parts) == 1:
        return [load_rows(ref if rows is None else ref.at[rows], first_query, tiling,
                          tiling.d_k)]
    return load_head_rows(ref, slice(None) if rows is None else rows, parts)


def store_row_parts(ref, values: list, tiling: Tiling) -> None:
    """Inverse of `load_row_parts` for a whole `[q_tile, h_pad, dk_pad]` block."""
    if len(tiling.k_parts) == 1:
        store_rows(ref, values[0], tiling, tiling.d_k)
    else:
        store_head_rows(ref, values, tiling.k_parts)


def store_rows(ref, rows, tiling: Tiling, dim: Optional[int]):
    """Inverse of `load_rows`: write rows `[q_tile * h_pad, (dim_pad)]` into a
    `[q_tile, h_pad(, dim_pad)]` block, skipping padded heads and features."""
    tile = rows.reshape(ref.shape).astype(ref.dtype)
    mask = None
    if ref.shape[1] != tiling.heads:
        mask = (jnp.arange(ref.shape[1]) < tiling.heads)[None, :]
        if dim is not None:
            mask = mask[:, :, None]
    if dim is not None and ref.shape[2] != dim:
        dim_mask = (jnp.arange(ref.shape[2]) < dim)[None, None, :]
        mask = dim_mask if mask is None else mask & dim_mask
    if mask is None:
        ref[...] = tile
    else:
        pltriton.store(ref, tile, mask=jnp.broadcast_to(mask, ref.shape))


def load_row_stats(ref, tiling: Tiling):
    """Load a `[q_tile, h_pad]` block of per-(query, head) float32 statistics as rows."""
    q_tile, h_pad = ref.shape
    if h_pad == tiling.heads:
        tile = ref[...]
    else:
        mask = jnp.broadcast_to((jnp.arange(h_pad) < tiling.heads)[None, :], ref.shape)
        tile = pltriton.load(ref, mask=mask, other=0.0)
    return tile.reshape(q_tile * h_pad)


def row_positions(first_query, q_tile: int, tiling: Tiling):
    """Query position `[rows]` of each row, and whether the row is a real (query, head)."""
    rows = jnp.arange(q_tile * tiling.h_pad, dtype=jnp.int32)
    # Explicit int32 constants: under `jax_enable_x64` a Python int would become int64.
    position = first_query + lax.div(rows, jnp.int32(tiling.h_pad))
    real = (position < tiling.seq_len) & (lax.rem(rows, jnp.int32(tiling.h_pad)) < tiling.heads)
    return position, real


def admissible(position, real, first_block, n_blocks: int, *, tiling: Tiling, cmp_block: int,
               cmp_stride: int, transposed: bool = False):
    """`[rows, n_blocks]` mask of the spec (`[n_blocks, rows]` when `transposed`): row's query
    `t` sees block `i` iff `i*d + l - 1 <= t` (and `i` exists)."""
    block = first_block + jnp.arange(n_blocks, dtype=jnp.int32)
    if transposed:
        visible = block[:, None] * cmp_stride + (cmp_block - 1) <= position[None, :]
        return visible & (block[:, None] < tiling.n_cmp) & real[None, :]
    visible = block[None, :] * cmp_stride + (cmp_block - 1) <= position[:, None]
    return visible & (block[None, :] < tiling.n_cmp) & real[:, None]


def blocks_visible_to(last_query, *, tiling: Tiling, cmp_block: int, cmp_stride: int):
    """Number of compressed blocks query `last_query` may attend: `i*d + l - 1 <= t`."""
    last_query = jnp.minimum(last_query, tiling.seq_len - 1)
    # (t - l + 1) // d + 1, written with a non-negative numerator so that integer division
    # truncation (all Triton has) equals floor division.
    count = lax.div(jnp.maximum(last_query - cmp_block + 1 + cmp_stride, 0),
                    jnp.int32(cmp_stride))
    return jnp.minimum(count, tiling.n_cmp)


def group_view(x, n_groups: int):
    """[B, T, H, D] -> [B, T, G, h, D] (free: a reshape)."""
    B, T, H = x.shape[:3]
    return x.reshape(B, T, n_groups, H // n_groups, *x.shape[3:])


def pad_rows(x, T_pad: int, tiling: Tiling, dim_pad: Optional[int], value=0):
    """[B, T, G, h(, D)] -> [B, T_pad, G, h_pad(, dim_pad)]: every block the kernels read is
    then inside its array. (Blocks wider than their array, read under masks, gave wrong dK on
    the GPU at d_v = 8 in bf16 while the interpreter agreed with the reference.)"""
    x = pad_axis(pad_axis(x, 1, T_pad, value=value), 3, tiling.h_pad, value=value)
    return x if dim_pad is None else pad_axis(x, 4, dim_pad)


def row_spec(q_tile: int, tiling: Tiling, dim_pad: Optional[int]):
    """BlockSpec of a `[q_tile, h_pad(, dim_pad)]` tile of a `[B, T, G, h(, D)]` array."""
    if dim_pad is None:
        return pl.BlockSpec((None, q_tile, None, tiling.h_pad), lambda b, i, g: (b, i, g, 0))
    return pl.BlockSpec((None, q_tile, None, tiling.h_pad, dim_pad),
                        lambda b, i, g: (b, i, g, 0, 0))


def kv_spec(n_blocks: int, dim_pad: int):
    """BlockSpec of all compressed keys of one (batch, group): `[n_blocks, dim_pad]`."""
    return pl.BlockSpec((None, n_blocks, None, dim_pad), lambda b, i, g: (b, 0, g, 0))


def check_inputs(q, k_cmp, v_cmp=None, *, cmp_block, cmp_stride, scale=None) -> float:
    """Validate BTHD shapes and the compression geometry; return the softmax scale."""
    for name, value in (("cmp_block", cmp_block), ("cmp_stride", cmp_stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d_k], got shape {q.shape}")
    if k_cmp.ndim != 4:
        raise ValueError(f"k_cmp must be [B, C, G, d_k], got shape {k_cmp.shape}")
    B, T, H, d_k = q.shape
    if k_cmp.shape[0] != B or k_cmp.shape[3] != d_k:
        raise ValueError(f"k_cmp {k_cmp.shape} must be [B={B}, C, G, d_k={d_k}] to match q "
                         f"{q.shape}")
    G = k_cmp.shape[2]
    if G == 0 or H % G:
        raise ValueError(f"the heads of q ({H}) must be a multiple of the heads of k_cmp ({G})")
    if v_cmp is not None:
        if v_cmp.ndim != 4 or v_cmp.shape[:3] != k_cmp.shape[:3]:
            raise ValueError(f"v_cmp {v_cmp.shape} must be [B, C, G, d_v] with B, C, G of k_cmp "
                             f"{k_cmp.shape}")
    if T == 0:
        raise ValueError("q must hold at least one query (T >= 1)")
    return softmax_scale(scale, d_k)


def reference_mask(T: int, C: int, cmp_block: int, cmp_stride: int, q_offset: int = 0):
    """`[T, C]` bool: query `q_offset + t` sees block `i` iff `i*d + l - 1 <= q_offset + t`."""
    position = q_offset + jnp.arange(T)[:, None]
    return cmp_admissible(jnp.arange(C)[None, :], position, cmp_block, cmp_stride)
