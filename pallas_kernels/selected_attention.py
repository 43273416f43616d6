"""NSA selected attention (spec step 7) as Pallas GPU kernels, forward and backward.

Query `t`, query head in KV group `g`, attends the tokens of the blocks `block_idx[b, t, g, :]`
(ignoring `-1`) that are `<= t`. Block `j` covers tokens `[j*l_sel, (j+1)*l_sel)`.

Forward (group-centric, as in the paper): one program per (token, KV head, batch). It loads the
`h` query heads of its group, `[h, d_k]` padded to the 16 rows a matrix-unit product needs, walks
the token's `n_sel` selected blocks read from `block_idx`, loads each `[l_sel, d]` K/V block by a
dynamic slice, cuts the keys `> t`, and keeps an online softmax in float32. It writes `o` and the
natural log-sum-exp `lse [B, T, H]`. A program can instead take a tile of consecutive tokens
(`BlockSizes.tokens_fwd` / `tokens_dq`): loading the blocks they share once, or, with
`stack_tokens`, stacking their rows over the union of their blocks; with `stack_max_union`, only
the tiles with small unions are stacked and the per-token kernel takes the others (sm90's
default, `pallas_kernels.profiles`).

Backward: `dq` mirrors the forward (p recomputed from lse, `delta = rowsum(o * do)` from XLA).
`dk, dv` are deterministic, without atomics: XLA inverts `block_idx` into, per (batch, KV head),
the list of queries that chose each block (one stable sort), cuts each block's list into work
items of at most `dkv_chunk` queries, and a KV-block-major kernel runs one program per work item,
gathering the `(query, head)` rows of its items into `[rows, d]` tiles. Each item writes its
float32 partial; a second kernel sums a block's partials in item order. Splitting lists keeps the
forced block 0, which every query selects, from serialising the pass on one SM.

Lowering: the Pallas Triton lowering (`implementation="triton"`); `"xla"` runs the reference.
A Mosaic GPU variant would sit beside it under its own `implementation` value. In-kernel offsets
stay small: every ref is per batch (and per KV head), and Pallas switches to 64-bit offsets for
arrays over 4 GiB, so T up to 256k does not overflow 32-bit arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (LOG2_E, LN_2, MASK, check_implementation,
                                    check_kernel_dtype, column_parts, dot, dot_parts, load_cols,
                                    load_head_rows, matmul_dim, next_pow2, online_softmax_finish,
                                    online_softmax_init, online_softmax_step, pad_axis,
                                    pallas_call, parts_width, store_cols)

__all__ = [
    "BlockSizes",
    "Stages",
    "random_block_idx",
    "selected_attention",
    "selected_attention_reference",
    "selected_attention_stages",
]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Launch parameters of the three kernels. Frozen and hashable (a jit static argument).

    Attributes:
      dkv_rows: (query, head) rows the dk/dv kernel gathers per step, a power of 2 >= 16; with
        `h` heads per group a step covers `dkv_rows // h` queries.
      dkv_chunk: queries per dk/dv work item; `None` means `2 * n_sel * l_sel` (twice a block's
        mean list length, so most blocks are one item and only the long lists split), cut to
        `max(DKV_MIN_CHUNK, T // DKV_ITEMS_PER_LIST)`: at short T the lists are cut finer so
        that the pass has enough items to fill the GPU.
      num_warps_* / num_stages_*: Triton launch parameters of the forward, dq and dk/dv kernels;
        num_warps_dkv_reduce: the warps of the kernel that sums the dk/dv partials (its
        `[tile, d]` float32 sums are 256 registers a thread at 4 warps and d 256).
      split_dk: a d_k that is the sum of two powers of two >= 16 (192 = 128 + 64, 96 = 64 + 32)
        enters the products as those two column parts, unpadded; False pads it to the next
        power of two (256 for 192), as before.
      tokens_fwd / tokens_dq: consecutive tokens a forward / dq program takes (a power of 2).
        Above 1, the program loads each block its first token selected once, for every token of
        the tile that selected it too (the forced initial and local blocks at least), then each
        token's other blocks (`_token_tile_plan`). The tile shrinks to the largest power of 2
        that divides T.
      stack_tokens: with token tiles, stack the tile's tokens into one `[P * h_pad, d]` query
        tile instead: the program walks the union of the tokens' blocks once, each block one
        product over every row, a row masked where its token did not select the block
        (`_fwd_stack_kernel`). Fewer block loads and full-height products, at the cost of
        products for rows that mask the block out (the union over P tokens against each token's
        n_sel). On every tile, faster only where neighbouring queries share most blocks (P 4 on
        4 warps); sm90's default stacks only the tiles whose union is small (`stack_max_union`;
        bench/RESULTS.md, Selection workloads).
      stack_max_union: with stack_tokens, a tile whose union holds more than this many blocks
        runs on the per-token kernel instead: each forward / dq pass launches the per-token
        kernel (on `num_warps_fwd` / `num_warps_dq`), whose programs skip the stacked tiles'
        tokens, then the stacked kernel (on `num_warps_stack`), whose programs skip the other
        tiles and write into the same output. The choice is per tile and on the GPU (no host
        round trip); the union sizes come from the same XLA pass as the union lists. None: every
        tile stacked.
      num_warps_stack: the warps of the stacked kernels; None: `num_warps_fwd` / `num_warps_dq`.
    """
    dkv_rows: int = 64
    dkv_chunk: int | None = None
    # 2 warps for the per-token kernels: their tiles are [h_pad, 64] (16 rows at h = 16), and on
    # an H200 at T = 64k, H 64, G 4, d 128 they ran 13% faster than with 4 (8 or 1 stage: slower).
    num_warps_fwd: int = 2
    num_stages_fwd: int = 2
    num_warps_dq: int = 2
    num_stages_dq: int = 2
    num_warps_dkv: int = 4
    num_stages_dkv: int = 2
    num_warps_dkv_reduce: int = 4
    split_dk: bool = True
    tokens_fwd: int = 1
    tokens_dq: int = 1
    stack_tokens: bool = False
    stack_max_union: int | None = None
    num_warps_stack: int | None = None

    def __post_init__(self):
        if self.dkv_rows < 16 or self.dkv_rows & (self.dkv_rows - 1):
            raise ValueError(f"dkv_rows ({self.dkv_rows}) must be a power of 2 >= 16")
        for name in ("tokens_fwd", "tokens_dq"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
                raise ValueError(f"{name} ({n!r}) must be a power of 2 >= 1")
        if not isinstance(self.stack_tokens, bool):
            raise ValueError(f"stack_tokens ({self.stack_tokens!r}) must be a bool")
        if self.stack_tokens and self.tokens_fwd == self.tokens_dq == 1:
            raise ValueError("stack_tokens stacks the tokens of a tile: it needs tokens_fwd or "
                             "tokens_dq > 1 (both are 1)")
        for name in ("stack_max_union", "num_warps_stack"):
            n = getattr(self, name)
            if n is None:
                continue
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} ({n!r}) must be None or a positive int")
            if not self.stack_tokens:
                raise ValueError(f"{name} ({n}) applies to stacked tiles: it needs "
                                 "stack_tokens=True")
        if self.dkv_chunk is not None and self.dkv_chunk < 1:
            raise ValueError(f"dkv_chunk ({self.dkv_chunk}) must be positive")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes every kernel of one call shares (padded for the Triton lowering)."""
    B: int
    T: int
    H: int
    G: int
    d_k: int
    d_v: int
    n_sel: int
    l_sel: int
    split_dk: bool = True

    @property
    def h(self) -> int:
        return self.H // self.G

    @property
    def h_pad(self) -> int:  # query rows of a forward/dq program
        return matmul_dim(self.h)

    @property
    def dk_parts(self) -> tuple:
        """(offset, width) column parts of q / k that enter `tl.dot` (`_common.column_parts`)."""
        return column_parts(self.d_k, self.split_dk)

    @property
    def dk_pad(self) -> int:  # the width of the q / k arrays the kernels read
        return parts_width(self.dk_parts)

    @property
    def dv_pad(self) -> int:
        return matmul_dim(self.d_v)

    @property
    def tile(self) -> int:  # keys loaded per block; the keys past l_sel are masked
        return matmul_dim(self.l_sel)

    @property
    def n_blocks(self) -> int:
        return -(-self.T // self.l_sel)

    @property
    def T_pad(self) -> int:  # every block's [start, start + tile) load stays in bounds
        return (self.n_blocks - 1) * self.l_sel + self.tile

    @property
    def n_sel_pad(self) -> int:
        return next_pow2(self.n_sel)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

# The products of these kernels, with the 16-bit lowering their GPU runs verified
# (`_common.dot`'s `highest_16bit`).
_dot = functools.partial(dot, highest_16bit=False)


def _scores(a_parts, b_parts):
    """sum over the column parts of a_p @ b_p^T (float32)."""
    return dot_parts(a_parts, b_parts, _dot)


def _dq_update(dq, s, keep, lse_log2, delta, do, k, v):
    """dq (its column parts, float32) + this block's `ds @ k`: s the scores `[rows, tile]` in
    the log2 domain, keep their mask, lse_log2 / delta `[rows]`, do `[rows, dv_pad]`."""
    p = jnp.where(keep, jnp.exp2(s - lse_log2[:, None]), 0.0)
    dp = _dot(do, v, trans_b=True)
    ds = (p * (dp - delta[:, None])).astype(v.dtype)
    return [acc + _dot(ds, k_part) for acc, k_part in zip(dq, k)]


def _program(program):
    """The program's index along the token axis: `program` where the caller read it (the split
    launch reads it outside its `pl.when`, which interpret mode needs), else the grid's."""
    return pl.program_id(0) if program is None else program


def _visit_bound(idx_ref):
    """1 + the last slot holding a block (>= 0): trailing -1 padding is never visited."""
    idx = idx_ref[...]
    slot = lax.broadcasted_iota(jnp.int32, idx.shape, 0)
    return jnp.max(jnp.where(idx >= 0, slot + 1, 0))


def _load_block(k_ref, v_ref, j, t, l_sel, tile, parts):
    """K (its column parts) and V `[tile, d]` of block j, and the keep mask `[1, tile]` of its
    keys for query t.

    A slot that does not take part (-1, or a block starting after t) loads block 0, fully
    masked, so the loop needs no branch."""
    live = (j >= 0) & (j * l_sel <= t)
    start = jnp.where(live, j, 0) * l_sel
    k = load_cols(k_ref, (pl.ds(start, tile),), parts)
    v = v_ref[pl.ds(start, tile), :]
    offset = lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    keep = live & (start + offset <= t) & (offset < l_sel)
    return k, v, keep


def _fwd_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, lse_ref, *, scale, l_sel, tile, parts,
                program=None):
    """One (token t, KV head g, batch b). q_ref [h_pad, dk_pad], k_ref [T_pad, dk_pad],
    v_ref [T_pad, dv_pad], idx_ref [n_sel_pad]; o_ref [h_pad, dv_pad], lse_ref [h_pad].
    parts: the (offset, width) column parts of q and k (`_Geometry.dk_parts`)."""
    t = _program(program)
    rows, dv = o_ref.shape
    q = load_cols(q_ref, (), parts)
    scale_log2 = scale * LOG2_E

    def visit(slot, carry):
        k, v, keep = _load_block(k_ref, v_ref, idx_ref[slot], t, l_sel, tile, parts)
        s = jnp.where(keep, _scores(q, k) * scale_log2, MASK)              # [h_pad, tile]
        return online_softmax_step(carry, s, v, _dot)

    carry = lax.fori_loop(0, _visit_bound(idx_ref), visit, online_softmax_init(rows, dv))
    # A row that met no admissible key (only possible for invalid block_idx) gets o = 0 and
    # lse = -inf, like the reference.
    o, lse_log2 = online_softmax_finish(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse_log2 * LN_2


def _dq_kernel(q_ref, k_ref, v_ref, idx_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, l_sel,
               tile, parts, program=None):
    """One (token t, KV head g, batch b): dq of the group's heads. Shapes as `_fwd_kernel`, with
    do_ref [h_pad, dv_pad], lse_ref / delta_ref [h_pad]; dq_ref [h_pad, dk_pad]."""
    t = _program(program)
    rows = dq_ref.shape[0]
    q = load_cols(q_ref, (), parts)
    do = do_ref[...]
    lse_log2 = lse_ref[...] * LOG2_E
    delta = delta_ref[...]
    scale_log2 = scale * LOG2_E

    def visit(slot, dq):
        k, v, keep = _load_block(k_ref, v_ref, idx_ref[slot], t, l_sel, tile, parts)
        return _dq_update(dq, _scores(q, k) * scale_log2, keep, lse_log2, delta, do, k, v)

    dq = lax.fori_loop(0, _visit_bound(idx_ref), visit,
                       [jnp.zeros((rows, w), jnp.float32) for _, w in parts])
    store_cols(dq_ref, [(x * scale).astype(dq_ref.dtype) for x in dq], parts)


# Token tiles (BlockSizes.tokens_fwd / tokens_dq > 1): a program of P consecutive tokens visits
# first the blocks of its first token's list, each loaded once for every token that selected it,
# then each token's remaining blocks. Visit lists are slot masks over a token's `n_sel_pad`
# slots, walked in slot order by rank (`_slot_ranks`, `_nth`): no gather, no sort, only
# comparisons and reductions of [n, n] tiles, which the Triton lowering has.

def _one(mask):
    return jnp.where(mask, jnp.int32(1), jnp.int32(0))


def _slot_ranks(mask):
    """(count, rank [n]) of a slot mask [n]: how many slots are set, and each slot's rank among
    them (the set slots before it), so a loop's visit i takes the set slot of rank i."""
    n = mask.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    rank = jnp.sum(_one((col < row) & mask[None, :]), axis=1)
    return jnp.sum(_one(mask)), rank


def _nth(values, mask, rank, i):
    """values at the set slot of rank i."""
    return jnp.sum(jnp.where(mask & (rank == i), values, jnp.int32(0)))


def _holds(row, j):
    """Whether the block list `row [n]` holds block j (j >= 0)."""
    return jnp.max(_one(row == j)) > 0


def _token_tile_plan(rows, ts, l_sel):
    """The visit plan of a token tile. rows: the tokens' block lists, each [n] (-1 padded); ts:
    their positions. Shared visits: the first occurrence of each block of token 0's list that
    starts at or before the tile's last token, loaded once; token p takes one when its own list
    holds it. Token p's own visits: the rest of its list (blocks token 0 lacks, and a repeat of a
    block, which the reference counts again), blocks starting after p skipped. Returns
    (shared mask [n] over token 0's slots, [own mask [n] over token p's slots for each p])."""
    n = rows[0].shape[0]
    r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def first(row):  # slot s holds the first occurrence of its block
        return jnp.max(_one((c < r) & (row[None, :] == row[:, None])), axis=1) == 0

    row0 = rows[0]
    shared = (row0 >= 0) & (row0 * l_sel <= ts[-1]) & first(row0)
    own = []
    for row, t in zip(rows, ts):
        in_shared = jnp.max(_one((row[:, None] == row0[None, :]) & shared[None, :]), axis=1) > 0
        own.append((row >= 0) & (row * l_sel <= t) & ~(in_shared & first(row)))
    return shared, own


def _tile_visits(rows, ts, l_sel, tile, k_ref, v_ref, parts, step, states):
    """Runs `step(state_p, p, k, v, keep_p)` over the tile's plan: the shared blocks for every
    token, then each token's own blocks. states: one carry per token; returns them updated."""
    shared, own = _token_tile_plan(rows, ts, l_sel)
    offset = lax.broadcasted_iota(jnp.int32, (1, tile), 1)

    count, rank = _slot_ranks(shared)

    def visit_shared(i, states):
        j = _nth(rows[0], shared, rank, i)
        start = j * l_sel
        k = load_cols(k_ref, (pl.ds(start, tile),), parts)
        v = v_ref[pl.ds(start, tile), :]
        out = []
        for p, (row, t) in enumerate(zip(rows, ts)):
            keep = _holds(row, j) & (start + offset <= t) & (offset < l_sel)
            out.append(step(states[p], p, k, v, keep))
        return out

    states = lax.fori_loop(0, count, visit_shared, list(states))
    for p, (row, t) in enumerate(zip(rows, ts)):
        count_p, rank_p = _slot_ranks(own[p])

        def visit_own(i, state, p=p, row=row, t=t, rank_p=rank_p):
            j = _nth(row, own[p], rank_p, i)
            k, v, keep = _load_block(k_ref, v_ref, j, t, l_sel, tile, parts)
            return step(state, p, k, v, keep)

        states[p] = lax.fori_loop(0, count_p, visit_own, states[p])
    return states


def _fwd_tile_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, lse_ref, *, scale, l_sel, tile, parts):
    """`_fwd_kernel` for a tile of P consecutive tokens (program i: tokens i*P ..): q_ref
    [P, h_pad, dk_pad], idx_ref [P, n_sel_pad]; o_ref [P, h_pad, dv_pad], lse_ref [P, h_pad]."""
    P, rows, dv = o_ref.shape
    t0 = pl.program_id(0) * P
    ts = [t0 + p for p in range(P)]
    idx = [idx_ref[p, :] for p in range(P)]
    q = [load_cols(q_ref, (p, pl.ds(0, rows)), parts) for p in range(P)]
    scale_log2 = scale * LOG2_E

    def step(state, p, k, v, keep):
        s = jnp.where(keep, _scores(q[p], k) * scale_log2, MASK)
        return online_softmax_step(state, s, v, _dot)

    states = _tile_visits(idx, ts, l_sel, tile, k_ref, v_ref, parts, step,
                          [online_softmax_init(rows, dv) for _ in range(P)])
    for p, state in enumerate(states):
        o, lse_log2 = online_softmax_finish(state)
        o_ref[p, :, :] = o.astype(o_ref.dtype)
        lse_ref[p, :] = lse_log2 * LN_2


def _dq_tile_kernel(q_ref, k_ref, v_ref, idx_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale,
                    l_sel, tile, parts):
    """`_dq_kernel` for a tile of P consecutive tokens; shapes as `_fwd_tile_kernel`, with
    do_ref [P, h_pad, dv_pad], lse_ref / delta_ref [P, h_pad]; dq_ref [P, h_pad, dk_pad]."""
    P, rows = dq_ref.shape[:2]
    t0 = pl.program_id(0) * P
    ts = [t0 + p for p in range(P)]
    idx = [idx_ref[p, :] for p in range(P)]
    q = [load_cols(q_ref, (p, pl.ds(0, rows)), parts) for p in range(P)]
    do = [do_ref[p, :, :] for p in range(P)]
    lse_log2 = [lse_ref[p, :] * LOG2_E for p in range(P)]
    delta = [delta_ref[p, :] for p in range(P)]
    scale_log2 = scale * LOG2_E

    def step(dq, p, k, v, keep):
        return _dq_update(dq, _scores(q[p], k) * scale_log2, keep, lse_log2[p], delta[p], do[p],
                          k, v)

    dqs = _tile_visits(idx, ts, l_sel, tile, k_ref, v_ref, parts, step,
                       [[jnp.zeros((rows, w), jnp.float32) for _, w in parts] for _ in range(P)])
    for p, dq in enumerate(dqs):
        store_cols(dq_ref, [(x * scale).astype(dq_ref.dtype) for x in dq], parts,
                   (p, slice(None)))


# Stacked token tiles (BlockSizes.stack_tokens): the P tokens' query rows form one
# `[P * h_pad, d]` tile (row r: token r // h_pad, head r % h_pad); the program visits the union
# of the tokens' blocks (`_tile_union`, built by XLA: ascending, each block once, -1 padded), and
# a block enters row r's softmax `count` times, count being how often row r's token lists it
# (0: masked; a repeat counts again, as in the reference): a score bias of log2(count).

def _row_bias(idx, j, row_token):
    """[R] float32: log2 of how often each row's token lists block j, MASK where it does not.
    idx: the tokens' block lists, each [n]; row_token [R]: each row's token."""
    count = jnp.zeros(row_token.shape, jnp.int32)
    for p, row in enumerate(idx):
        count = jnp.where(row_token == p, jnp.sum(_one(row == j)), count)
    return jnp.where(count > 0, jnp.log2(jnp.maximum(count, 1).astype(jnp.float32)), MASK)


def _stack_visit(k_ref, v_ref, idx, j, t0, row_token, l_sel, tile, parts):
    """K (its column parts) and V of union block j, the score bias [R, 1] of its rows and their
    keep mask [R, tile] (the row's token lists it, the key is at or before the token)."""
    start = j * l_sel
    k = load_cols(k_ref, (pl.ds(start, tile),), parts)
    v = v_ref[pl.ds(start, tile), :]
    bias = _row_bias(idx, j, row_token)[:, None]
    offset = lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    keep = (bias > 0.5 * MASK) & (start + offset <= t0 + row_token[:, None]) & (offset < l_sel)
    return k, v, bias, keep


def _stack_rows(P, h_pad):
    """[P * h_pad] int32: the token of each row of a stacked tile."""
    return lax.div(lax.broadcasted_iota(jnp.int32, (P * h_pad,), 0), jnp.int32(h_pad))


def _fwd_stack_kernel(q_ref, k_ref, v_ref, idx_ref, union_ref, o_ref, lse_ref, *, scale, l_sel,
                      tile, parts, program=None):
    """`_fwd_tile_kernel` on one stacked tile: q_ref [P, h_pad, dk_pad], idx_ref
    [P, n_sel_pad], union_ref [P * n_sel_pad]; o_ref [P, h_pad, dv_pad], lse_ref [P, h_pad]."""
    P, h_pad, dv = o_ref.shape
    t0 = _program(program) * P
    row_token = _stack_rows(P, h_pad)
    idx = [idx_ref[p, :] for p in range(P)]
    q = load_head_rows(q_ref, slice(None), parts)
    scale_log2 = scale * LOG2_E

    def visit(u, carry):
        k, v, bias, keep = _stack_visit(k_ref, v_ref, idx, union_ref[u], t0, row_token, l_sel,
                                        tile, parts)
        s = jnp.where(keep, _scores(q, k) * scale_log2 + bias, MASK)
        return online_softmax_step(carry, s, v, _dot)

    carry = lax.fori_loop(0, _visit_bound(union_ref), visit,
                          online_softmax_init(P * h_pad, dv))
    o, lse_log2 = online_softmax_finish(carry)
    o_ref[...] = o.reshape(P, h_pad, dv).astype(o_ref.dtype)
    lse_ref[...] = (lse_log2 * LN_2).reshape(P, h_pad)


def _dq_stack_kernel(q_ref, k_ref, v_ref, idx_ref, union_ref, do_ref, lse_ref, delta_ref, dq_ref,
                     *, scale, l_sel, tile, parts, program=None):
    """`_dq_tile_kernel` on one stacked tile; shapes as `_fwd_stack_kernel`, with do_ref
    [P, h_pad, dv_pad], lse_ref / delta_ref [P, h_pad]; dq_ref [P, h_pad, dk_pad]."""
    P, h_pad = dq_ref.shape[:2]
    R = P * h_pad
    t0 = _program(program) * P
    row_token = _stack_rows(P, h_pad)
    idx = [idx_ref[p, :] for p in range(P)]
    q = load_head_rows(q_ref, slice(None), parts)
    do = load_head_rows(do_ref, slice(None), ((0, do_ref.shape[2]),))[0]
    lse_log2 = lse_ref[...].reshape(R) * LOG2_E
    delta = delta_ref[...].reshape(R)
    scale_log2 = scale * LOG2_E

    def visit(u, dq):
        k, v, bias, keep = _stack_visit(k_ref, v_ref, idx, union_ref[u], t0, row_token, l_sel,
                                        tile, parts)
        return _dq_update(dq, _scores(q, k) * scale_log2 + bias, keep, lse_log2, delta, do, k,
                          v)

    dq = lax.fori_loop(0, _visit_bound(union_ref), visit,
                       [jnp.zeros((R, w), jnp.float32) for _, w in parts])
    store_cols(dq_ref, [(x * scale).astype(dq_ref.dtype).reshape(P, h_pad, w)
                        for x, (_, w) in zip(dq, parts)], parts, (slice(None), slice(None)))


def _dkv_kernel(item_block_ref, item_lo_ref, item_hi_ref, qlist_ref, q_ref, do_ref, lse_ref,
                delta_ref, k_ref, v_ref, dk_ref, dv_ref, *, scale, l_sel, tile, h, H, rows, parts):
    """One (work item w, KV head g, batch b): the dk, dv contribution of the queries at positions
    [lo, hi) of block j's query list. item_*_ref [W], qlist_ref [L] (query positions),
    q_ref [T*H, dk_pad] and do_ref [T*H, dv_pad] (row t*H + head), lse_ref / delta_ref [T*H],
    k_ref [T_pad, dk_pad], v_ref [T_pad, dv_pad]; dk_ref [tile, dk_pad], dv_ref [tile, dv_pad]
    (float32 partials)."""
    w, g = pl.program_id(0), pl.program_id(1)
    j, lo, hi = item_block_ref[w], item_lo_ref[w], item_hi_ref[w]
    start = j * l_sel
    k = load_cols(k_ref, (pl.ds(start, tile),), parts)
    v = v_ref[pl.ds(start, tile), :]
    scale_log2 = scale * LOG2_E
    queries_per_step = rows // h
    # Row r of a step is (query slot r // h, head g*h + r % h); rows past h*queries_per_step idle.
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    # int32 divisors: lax.div / lax.rem want one dtype, and under jax_enable_x64 a Python int
    # operand would be int64.
    slot, head = lax.div(r, jnp.int32(h)), lax.rem(r, jnp.int32(h))
    key_pos = start + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
    key_in_block = lax.broadcasted_iota(jnp.int32, (tile, 1), 0) < l_sel

    def step(c, carry):
        dk, dv = carry
        pos = lo + c * queries_per_step + slot
        valid = (pos < hi) & (slot < queries_per_step)
        t_row = jnp.where(valid, qlist_ref[pos], 0)
        row = t_row * H + g * h + head
        q = load_cols(q_ref, (row,), parts)
        do = do_ref[row, :]
        lse_log2 = lse_ref[row] * LOG2_E
        delta = delta_ref[row]
        s = _scores(k, q) * scale_log2                             # [tile, rows]
        keep = (key_pos <= t_row[None, :]) & valid[None, :] & key_in_block
        p = jnp.where(keep, jnp.exp2(s - lse_log2[None, :]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do)                     # [tile, dv_pad]
        dp = _dot(v, do, trans_b=True)                             # [tile, rows]
        ds = (p * (dp - delta[None, :])).astype(do.dtype)
        dk = [acc + _dot(ds, q_part) for acc, q_part in zip(dk, q)]  # [tile, width] each
        return dk, dv

    n_steps = lax.div(hi - lo + queries_per_step - 1, jnp.int32(queries_per_step))
    dk, dv = lax.fori_loop(0, n_steps, step,
                           ([jnp.zeros((tile, w), jnp.float32) for _, w in parts],
                            jnp.zeros(dv_ref.shape, jnp.float32)))
    store_cols(dk_ref, [x * scale for x in dk], parts)
    dv_ref[...] = dv


def _dkv_reduce_kernel(item_start_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref, *, parts):
    """One (block j, KV head g, batch b): sum block j's item partials in item order.
    item_start_ref [n_blocks + 1], *_part_ref [W, tile, d_pad]; dk_ref / dv_ref [tile, d_pad]
    (dk in its column parts)."""
    j = pl.program_id(0)
    tile = dk_ref.shape[0]

    def add(w, carry):
        dk, dv = carry
        if len(parts) == 1:
            dk_w = [dk_part_ref[w]]
        else:
            dk_w = [dk_part_ref[w, pl.ds(0, tile), pl.ds(o, n)] for o, n in parts]
        return [a + b for a, b in zip(dk, dk_w)], dv + dv_part_ref[w]

    dk, dv = lax.fori_loop(item_start_ref[j], item_start_ref[j + 1], add,
                           ([jnp.zeros((tile, n), jnp.float32) for _, n in parts],
                            jnp.zeros(dv_ref.shape, jnp.float32)))
    store_cols(dk_ref, [x.astype(dk_ref.dtype) for x in dk], parts)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------------
# Wrappers
# ------------------------------------------------------------------------------------------------

def _group_rows(x: jax.Array, geo: _Geometry, d_pad: int) -> jax.Array:
    """[B, T, H, d] -> [B, T, G, h_pad, d_pad], zero rows for the padded heads."""
    x = x.reshape(geo.B, geo.T, geo.G, geo.h, x.shape[-1])
    return pad_axis(pad_axis(x, 3, geo.h_pad), 4, d_pad)


def _padded_kv(k, v, geo: _Geometry):
    k = pad_axis(pad_axis(k, 1, geo.T_pad), 3, geo.dk_pad)
    v = pad_axis(pad_axis(v, 1, geo.T_pad), 3, geo.dv_pad)
    return k, v


def _token_tile(geo: _Geometry, tokens: int) -> int:
    """Tokens a forward / dq program takes: `tokens`, halved until it divides T."""
    while geo.T % tokens:
        tokens //= 2
    return tokens


def _token_specs(geo: _Geometry, tokens: int = 1):
    """BlockSpecs of the per-token (forward, dq) kernels, grid (T / tokens, G, B); a tile of
    more than one token keeps its token axis."""
    P = None if tokens == 1 else tokens
    rows = lambda d: pl.BlockSpec((None, P, None, geo.h_pad, d), lambda t, g, b: (b, t, g, 0, 0))
    vec = pl.BlockSpec((None, P, None, geo.h_pad), lambda t, g, b: (b, t, g, 0))
    kv = lambda d: pl.BlockSpec((None, geo.T_pad, None, d), lambda t, g, b: (b, 0, g, 0))
    idx = pl.BlockSpec((None, P, None, geo.n_sel_pad), lambda t, g, b: (b, t, g, 0))
    return rows, vec, kv, idx


def _tile_union(idx, geo: _Geometry, tokens: int):
    """The blocks each tile of `tokens` consecutive queries visits when stacked: int32
    `[B, T / tokens, G, tokens * n_sel_pad]`, ascending, each block once, -1 padded; blocks
    that start after the tile's last token left out. idx `[B, T, G, n_sel_pad]`, -1 padded."""
    B, T, G, n = idx.shape
    x = idx.reshape(B, T // tokens, tokens, G, n).transpose(0, 1, 3, 2, 4)
    x = x.reshape(B, T // tokens, G, tokens * n)
    last = (jnp.arange(T // tokens, dtype=jnp.int32) * tokens + tokens - 1)[None, :, None, None]
    big = jnp.iinfo(jnp.int32).max
    x = jnp.sort(jnp.where((x >= 0) & (x * geo.l_sel <= last), x, big), axis=-1)
    repeat = jnp.concatenate([jnp.zeros_like(x[..., :1], bool), x[..., 1:] == x[..., :-1]], -1)
    x = jnp.sort(jnp.where(repeat, big, x), axis=-1)
    return jnp.where(x == big, -1, x)


def _split_by_union(kernel, stacked: bool, max_union: int, n_out: int, aliased: bool):
    """`kernel` behind a leading `count_ref [1]`, its tile's union size: it runs where the tile
    is stacked (count <= max_union) if `stacked`, else where it is not; elsewhere the program
    writes nothing. With `aliased`, the n_out refs before the outputs (the earlier launch's
    outputs, which this launch writes into) are dropped."""
    def split(count_ref, *refs, **kwargs):
        if aliased:
            refs = refs[:-2 * n_out] + refs[-n_out:]
        is_stacked = count_ref[0] <= max_union
        program = pl.program_id(0)
        pl.when(is_stacked if stacked else jnp.logical_not(is_stacked))(
            lambda: kernel(*refs, program=program, **kwargs))
    return split


def _launch_tiles(kernels: tuple, *, name: str, geo: _Geometry, bs: BlockSizes, tokens: int,
                  num_warps: int, num_stages: int, head: tuple, tail: tuple, specs: Callable,
                  out_shape: list, interpret: bool, debug: bool, **kwargs):
    """One forward / dq pass over tiles of `tokens` queries, grid (T / tokens, G, B).

    kernels: (per-token, token tile, stacked). head: (q, k, v, idx) with idx `[B, T, G,
    n_sel_pad]`; tail: the arrays after them. specs(tokens) -> (head specs, tail specs, out
    specs) for tiles of that many tokens. The stacked kernel takes the tile's union list
    between head and tail. With `bs.stack_max_union`, the per-token kernel runs first on the
    tiles whose union exceeds it and the stacked one writes the others into its outputs."""
    tokens = _token_tile(geo, tokens)

    def launch(kernel, tokens, warps, extra=(), extra_specs=(), prior=(), pre=(), pre_specs=()):
        head_specs, tail_specs, out_specs = specs(tokens)
        n_in = len(pre) + len(head) + len(extra) + len(tail)
        return pallas_call(
            functools.partial(kernel, **kwargs), name=name + ("_stacked" if extra else ""),
            num_warps=warps, num_stages=num_stages, interpret=interpret, debug=debug,
            grid=(geo.T // tokens, geo.G, geo.B),
            in_specs=[*pre_specs, *head_specs, *extra_specs, *tail_specs,
                      *(out_specs if prior else ())],
            out_specs=out_specs, out_shape=out_shape,
            input_output_aliases={n_in + i: i for i in range(len(prior))},
        )(*pre, *head, *extra, *tail, *prior)

    if tokens == 1:
        return launch(kernels[0], 1, num_warps)
    if not bs.stack_tokens:
        return launch(kernels[1], tokens, num_warps)
    union = _tile_union(head[3], geo, tokens)
    union_spec = pl.BlockSpec((None, None, None, tokens * geo.n_sel_pad),
                              lambda t, g, b: (b, t, g, 0))
    stack_warps = bs.num_warps_stack or num_warps
    if bs.stack_max_union is None:
        return launch(kernels[2], tokens, stack_warps, [union], [union_spec])
    count = jnp.sum(union >= 0, axis=-1, dtype=jnp.int32)[..., None]   # [B, T / P, G, 1]
    P, n_out = tokens, len(out_shape)
    count_spec = lambda P_spec: pl.BlockSpec(
        (None, None, None, 1), lambda t, g, b: (b, t // P_spec, g, 0))
    split = functools.partial(_split_by_union, max_union=bs.stack_max_union, n_out=n_out)
    per_token = launch(split(kernels[0], stacked=False, aliased=False), 1, num_warps,
                       pre=[count], pre_specs=[count_spec(P)])
    return launch(split(kernels[2], stacked=True, aliased=True), P, stack_warps, [union],
                  [union_spec], prior=per_token, pre=[count], pre_specs=[count_spec(1)])


def _forward(q, k, v, block_idx, geo: _Geometry, scale, bs: BlockSizes, interpret, debug):
    qg = _group_rows(q, geo, geo.dk_pad)
    kp, vp = _padded_kv(k, v, geo)
    idx = pad_axis(block_idx.astype(jnp.int32), 3, geo.n_sel_pad, value=-1)

    def specs(tokens):
        rows, vec, kv, idx_spec = _token_specs(geo, tokens)
        return ([rows(geo.dk_pad), kv(geo.dk_pad), kv(geo.dv_pad), idx_spec], [],
                [rows(geo.dv_pad), vec])

    o, lse = _launch_tiles(
        (_fwd_kernel, _fwd_tile_kernel, _fwd_stack_kernel), name="nsa_selected_attention_fwd",
        geo=geo, bs=bs, tokens=bs.tokens_fwd, num_warps=bs.num_warps_fwd,
        num_stages=bs.num_stages_fwd, head=(qg, kp, vp, idx), tail=(), specs=specs,
        out_shape=[jax.ShapeDtypeStruct((geo.B, geo.T, geo.G, geo.h_pad, geo.dv_pad), q.dtype),
                   jax.ShapeDtypeStruct((geo.B, geo.T, geo.G, geo.h_pad), jnp.float32)],
        interpret=interpret, debug=debug, scale=scale, l_sel=geo.l_sel, tile=geo.tile,
        parts=geo.dk_parts)
    o = o[:, :, :, :geo.h, :geo.d_v].reshape(geo.B, geo.T, geo.H, geo.d_v)
    lse = lse[..., :geo.h].reshape(geo.B, geo.T, geo.H)
    return o, lse


def _backward_dq(q, k, v, block_idx, do, lse, delta, geo, scale, bs, interpret, debug):
    qg = _group_rows(q, geo, geo.dk_pad)
    dog = _group_rows(do, geo, geo.dv_pad)
    kp, vp = _padded_kv(k, v, geo)
    idx = pad_axis(block_idx.astype(jnp.int32), 3, geo.n_sel_pad, value=-1)
    per_row = lambda x: pad_axis(x.reshape(geo.B, geo.T, geo.G, geo.h), 3, geo.h_pad)

    def specs(tokens):
        rows, vec, kv, idx_spec = _token_specs(geo, tokens)
        return ([rows(geo.dk_pad), kv(geo.dk_pad), kv(geo.dv_pad), idx_spec],
                [rows(geo.dv_pad), vec, vec], [rows(geo.dk_pad)])

    (dq,) = _launch_tiles(
        (_dq_kernel, _dq_tile_kernel, _dq_stack_kernel), name="nsa_selected_attention_dq",
        geo=geo, bs=bs, tokens=bs.tokens_dq, num_warps=bs.num_warps_dq,
        num_stages=bs.num_stages_dq, head=(qg, kp, vp, idx),
        tail=(dog, per_row(lse), per_row(delta)), specs=specs,
        out_shape=[jax.ShapeDtypeStruct((geo.B, geo.T, geo.G, geo.h_pad, geo.dk_pad),
                                        q.dtype)],
        interpret=interpret, debug=debug, scale=scale, l_sel=geo.l_sel, tile=geo.tile,
        parts=geo.dk_parts)
    return dq[:, :, :, :geo.h, :geo.d_k].reshape(geo.B, geo.T, geo.H, geo.d_k)


# The default dk/dv work item: at most T / 16 queries, and no fewer than 512. On an H200
# (n_sel 16, l_sel 64: 2,048 queries uncut) the selected branch's forward+backward took 8% less
# at 8k and 2-3% less at 16k, and the same at 64k (bench/RESULTS.md, Selection workloads).
DKV_ITEMS_PER_LIST = 16
DKV_MIN_CHUNK = 512


def _dkv_chunk(geo: _Geometry, bs: BlockSizes) -> int:
    chunk = bs.dkv_chunk
    if chunk is None:
        chunk = min(2 * geo.n_sel * geo.l_sel, max(DKV_MIN_CHUNK, geo.T // DKV_ITEMS_PER_LIST))
    return max(1, min(chunk, geo.T))


def _dkv_work_items(geo: _Geometry, chunk: int) -> int:
    """Work items of the dk/dv pass per (batch, KV head): `n_blocks + ceil(T*n_sel / chunk)`
    bounds `sum_j ceil(n_j / chunk)` over the blocks' query counts n_j."""
    return geo.n_blocks + -(-geo.T * geo.n_sel // chunk)


def _dkv_rows(geo: _Geometry, bs: BlockSizes) -> int:
    """Rows (query x head) of one dk/dv step, at least a matmul dimension; the step takes
    `_dkv_rows // h` whole queries."""
    return max(bs.dkv_rows, matmul_dim(geo.h))


def _inverse_index(block_idx, geo: _Geometry, chunk: int, pad: int):
    """Per (batch, KV head): which queries chose each block, cut into work items.

    Returns `qlist [B, G, T*n_sel + pad]` (query positions grouped by block, ascending within a
    block), `item_block, item_lo, item_hi [B, G, W]` (work item w covers qlist[lo:hi] of block
    item_block; items past the last real one are empty), and `item_start [B, G, n_blocks + 1]`
    (block j owns items item_start[j] .. item_start[j+1]-1). W = n_blocks + ceil(T*n_sel/chunk)
    bounds the item count, since sum_j ceil(n_j / chunk) <= n_blocks + sum_j n_j / chunk.
    """
    T, nb = geo.T, geo.n_blocks
    n_items = _dkv_work_items(geo, chunk)
    t = jnp.arange(T, dtype=jnp.int32)[:, None]

    def one(blk):  # blk [T, n_sel] of one (b, g)
        chosen = (blk >= 0) & (blk * geo.l_sel <= t)
        key = jnp.where(chosen, blk, nb).reshape(-1)
        who = jnp.broadcast_to(t, blk.shape).reshape(-1)
        # Entries are t-major, so a stable sort on the block keeps each block's queries ascending.
        key, who = lax.sort((key, who), num_keys=1, is_stable=True)
        offsets = jnp.searchsorted(key, jnp.arange(nb + 1, dtype=jnp.int32),
                                   side="left").astype(jnp.int32)
        counts = offsets[1:] - offsets[:-1]
        items = (counts + chunk - 1) // chunk
        item_start = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                      jnp.cumsum(items, dtype=jnp.int32)])
        w = jnp.arange(n_items, dtype=jnp.int32)
        real = w < item_start[-1]
        block = jnp.clip(jnp.searchsorted(item_start, w, side="right").astype(jnp.int32) - 1,
                         0, nb - 1)
        lo = offsets[block] + (w - item_start[block]) * chunk
        hi = jnp.minimum(lo + chunk, offsets[block + 1])
        block = jnp.where(real, block, 0)
        lo = jnp.where(real, lo, 0)
        hi = jnp.where(real, hi, 0)
        qlist = jnp.concatenate([who, jnp.zeros((pad,), jnp.int32)])
        return qlist, block, lo, hi, item_start

    per_group = jnp.transpose(block_idx.astype(jnp.int32), (0, 2, 1, 3))  # [B, G, T, n_sel]
    return jax.vmap(jax.vmap(one))(per_group)


def _backward_dkv(q, k, v, block_idx, do, lse, delta, geo, scale, bs, interpret, debug):
    B, T, H, G = geo.B, geo.T, geo.H, geo.G
    rows = _dkv_rows(geo, bs)
    queries_per_step = rows // geo.h
    chunk = _dkv_chunk(geo, bs)
    qlist, item_block, item_lo, item_hi, item_start = _inverse_index(
        block_idx, geo, chunk, pad=queries_per_step)
    n_items = item_block.shape[-1]

    q_rows = pad_axis(q, 3, geo.dk_pad).reshape(B, T * H, geo.dk_pad)
    do_rows = pad_axis(do, 3, geo.dv_pad).reshape(B, T * H, geo.dv_pad)
    lse_rows = lse.reshape(B, T * H)
    delta_rows = delta.reshape(B, T * H)
    kp, vp = _padded_kv(k, v, geo)

    table = pl.BlockSpec((None, None, n_items), lambda w, g, b: (b, g, 0))
    qlist_spec = pl.BlockSpec((None, None, qlist.shape[-1]), lambda w, g, b: (b, g, 0))
    row_spec = lambda d: pl.BlockSpec((None, T * H, d), lambda w, g, b: (b, 0, 0))
    vec_spec = pl.BlockSpec((None, T * H), lambda w, g, b: (b, 0))
    kv_spec = lambda d: pl.BlockSpec((None, geo.T_pad, None, d), lambda w, g, b: (b, 0, g, 0))
    part_spec = lambda d: pl.BlockSpec((None, None, None, geo.tile, d),
                                       lambda w, g, b: (b, g, w, 0, 0))
    kernel = functools.partial(_dkv_kernel, scale=scale, l_sel=geo.l_sel, tile=geo.tile,
                               h=geo.h, H=H, rows=rows, parts=geo.dk_parts)
    dk_part, dv_part = pallas_call(
        kernel, name="nsa_selected_attention_dkv", num_warps=bs.num_warps_dkv,
        num_stages=bs.num_stages_dkv, interpret=interpret, debug=debug,
        grid=(n_items, G, B),
        in_specs=[table, table, table, qlist_spec, row_spec(geo.dk_pad), row_spec(geo.dv_pad),
                  vec_spec, vec_spec, kv_spec(geo.dk_pad), kv_spec(geo.dv_pad)],
        out_specs=[part_spec(geo.dk_pad), part_spec(geo.dv_pad)],
        out_shape=[jax.ShapeDtypeStruct((B, G, n_items, geo.tile, geo.dk_pad), jnp.float32),
                   jax.ShapeDtypeStruct((B, G, n_items, geo.tile, geo.dv_pad), jnp.float32)],
    )(item_block, item_lo, item_hi, qlist, q_rows, do_rows, lse_rows, delta_rows, kp, vp)

    nb = geo.n_blocks
    parts_spec = lambda d: pl.BlockSpec((None, None, n_items, geo.tile, d),
                                        lambda j, g, b: (b, g, 0, 0, 0))
    out_spec = lambda d: pl.BlockSpec((None, None, geo.tile, None, d),
                                      lambda j, g, b: (b, j, 0, g, 0))
    dk, dv = pallas_call(
        functools.partial(_dkv_reduce_kernel, parts=geo.dk_parts),
        name="nsa_selected_attention_dkv_reduce", num_warps=bs.num_warps_dkv_reduce,
        num_stages=1, interpret=interpret, debug=debug, grid=(nb, G, B),
        in_specs=[pl.BlockSpec((None, None, nb + 1), lambda j, g, b: (b, g, 0)),
                  parts_spec(geo.dk_pad), parts_spec(geo.dv_pad)],
        out_specs=[out_spec(geo.dk_pad), out_spec(geo.dv_pad)],
        out_shape=[jax.ShapeDtypeStruct((B, nb, geo.tile, G, geo.dk_pad), k.dtype),
                   jax.ShapeDtypeStruct((B, nb, geo.tile, G, geo.dv_pad), v.dtype)],
    )(item_start, dk_part, dv_part)

    def unblock(x, d):  # [B, nb, tile, G, d_pad] -> [B, T, G, d]
        x = x[:, :, :geo.l_sel].reshape(B, nb * geo.l_sel, G, x.shape[-1])
        return x[:, :T, :, :d]

    return unblock(dk, geo.d_k), unblock(dv, geo.d_v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _selected_attention(q, k, v, block_idx, geo, scale, block_sizes, interpret, debug):
    return _forward(q, k, v, block_idx, geo, scale, block_sizes, interpret, debug)[0]


def _selected_attention_fwd(q, k, v, block_idx, geo, scale, block_sizes, interpret, debug):
    o, lse = _forward(q, k, v, block_idx, geo, scale, block_sizes, interpret, debug)
    return o, (q, k, v, block_idx, o, lse)


def _selected_attention_bwd(geo, scale, block_sizes, interpret, debug, residuals, do):
    q, k, v, block_idx, o, lse = residuals
    do = do.astype(o.dtype)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, H]
    args = (q, k, v, block_idx, do, lse, delta, geo, scale, block_sizes, interpret, debug)
    dq = _backward_dq(*args)
    dk, dv = _backward_dkv(*args)
    return dq, dk, dv, None


_selected_attention.defvjp(_selected_attention_fwd, _selected_attention_bwd)


def _validate(q, k, v, block_idx, block_size) -> _Geometry:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, d_k], got shape {q.shape}")
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"k and v must be [B, T, G, d], got shapes {k.shape} and {v.shape}")
    B, T, H, d_k = q.shape
    G = k.shape[2]
    if k.shape[:2] != (B, T) or v.shape[:3] != (B, T, G):
        raise ValueError(f"k {k.shape} and v {v.shape} must share B, T (and G) with q {q.shape}")
    if k.shape[3] != d_k:
        raise ValueError(f"k's head dim ({k.shape[3]}) must equal q's d_k ({d_k})")
    if H % G:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's KV heads ({G})")
    if block_idx.ndim != 4 or block_idx.shape[:3] != (B, T, G):
        raise ValueError(f"block_idx must be [B, T, G, n_sel] = [{B}, {T}, {G}, n_sel], got "
                         f"{block_idx.shape}")
    if not jnp.issubdtype(block_idx.dtype, jnp.integer):
        raise ValueError(f"block_idx must hold integers, got {block_idx.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size ({block_size!r}) must be a positive int")
    if T == 0 or block_idx.shape[3] == 0:
        raise ValueError(f"T ({T}) and n_sel ({block_idx.shape[3]}) must be positive")
    return _Geometry(B=B, T=T, H=H, G=G, d_k=d_k, d_v=v.shape[3], n_sel=block_idx.shape[3],
                     l_sel=block_size)


# The most query rows a default stacked tile holds (P tokens x the group's padded heads): the
# tile the stacked kernels were timed with (4 tokens of 16 heads, 4 warps).
STACK_ROWS = 64


def _default_block_sizes(q, k, v, block_sizes: BlockSizes | None) -> BlockSizes:
    """`block_sizes`, or the tiles of this GPU architecture and head dims (`profiles`), a
    stacked tile cut to at most `STACK_ROWS` rows (one token a program where a group's heads
    fill them); NotImplementedError where it has none for them."""
    if block_sizes is not None:
        return block_sizes
    from pallas_kernels import profiles
    bs = profiles.block_sizes("selected", q.dtype, q.shape[-1], v.shape[-1])
    h_pad = matmul_dim(q.shape[2] // k.shape[2])
    tokens = max(bs.tokens_fwd, bs.tokens_dq)
    if not bs.stack_tokens or tokens * h_pad <= STACK_ROWS:
        return bs
    fit = STACK_ROWS // h_pad
    if fit < 2:
        return dataclasses.replace(bs, tokens_fwd=1, tokens_dq=1, stack_tokens=False,
                                   stack_max_union=None, num_warps_stack=None)
    max_union = None if bs.stack_max_union is None else bs.stack_max_union * fit // tokens
    return dataclasses.replace(bs, tokens_fwd=min(bs.tokens_fwd, fit),
                               tokens_dq=min(bs.tokens_dq, fit), stack_max_union=max_union)


def selected_attention(q, k, v, block_idx, block_size: int, scale: float | None = None, *,
                       block_sizes: BlockSizes | None = None, interpret: bool = False,
                       debug: bool = False, implementation: str = "triton"):
    """NSA selected attention (spec step 7).

    Args:
      q: `[B, T, H, d_k]`; k: `[B, T, G, d_k]`; v: `[B, T, G, d_v]`, one float dtype.
      block_idx: int `[B, T, G, n_sel]`, the chosen blocks of each query and KV head, ascending,
        `-1` padded. Entries that are -1 or start after t are ignored.
      block_size: l_sel, tokens per selection block.
      scale: softmax scale, `1/sqrt(d_k)` when None.
      block_sizes: launch parameters (None: this GPU architecture's, `pallas_kernels.profiles`).
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      implementation: "triton" (Pallas Triton lowering) or "xla" (the reference).

    Raises NotImplementedError for inputs outside `_common.KERNEL_DTYPES` (float64) with
    "triton", and for head dims the architecture has no tiles for (`profiles`).

    Returns:
      o: `[B, T, H, d_v]` in q's dtype. Differentiable in q, k, v.
    """
    check_implementation(implementation)
    _validate(q, k, v, block_idx, block_size)
    if implementation == "triton":
        check_kernel_dtype("selected_attention", q.dtype)
        # Resolved here, outside the jit: its cache key then holds the architecture's tiles.
        block_sizes = _default_block_sizes(q, k, v, block_sizes)
    return _selected_attention_jit(q, k, v, block_idx, block_size, scale,
                                   block_sizes=block_sizes, interpret=interpret, debug=debug,
                                   implementation=implementation)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "block_sizes", "interpret",
                                             "debug", "implementation"))
def _selected_attention_jit(q, k, v, block_idx, block_size: int, scale: float | None, *,
                            block_sizes: BlockSizes | None, interpret: bool, debug: bool,
                            implementation: str):
    check_implementation(implementation)
    geo = _validate(q, k, v, block_idx, block_size)
    scale = 1.0 / math.sqrt(geo.d_k) if scale is None else float(scale)
    if implementation == "xla":
        return selected_attention_reference(q, k, v, block_idx, block_size, scale)
    check_kernel_dtype("selected_attention", q.dtype)
    if geo.B == 0:  # an empty batch: no grid to launch (its blocks would be out of bounds)
        return jnp.zeros((0, geo.T, geo.H, geo.d_v), q.dtype)
    bs = block_sizes or BlockSizes()
    geo = dataclasses.replace(geo, split_dk=bs.split_dk)
    return _selected_attention(q, k, v, block_idx, geo, scale, bs, interpret, debug)


class Stages(NamedTuple):
    """The kernel's stages as separate callables (for timing them apart; `selected_attention`
    runs the same functions). `do`: the output's cotangent `[B, T, H, d_v]`; `lse` `[B, T, H]`
    (float32, natural log) from `forward`; `delta = sum(o * do, -1)` `[B, T, H]` float32."""

    forward: Callable          # (q, k, v) -> (o, lse)
    backward_dq: Callable      # (q, k, v, do, lse, delta) -> dq
    inverse_index: Callable    # (block_idx) -> the dk/dv pass's work list (XLA)
    backward_dkv: Callable     # (q, k, v, do, lse, delta) -> (dk, dv), the index included
    dkv_work_items: int        # work items of the dk/dv pass per (batch, KV head)


def selected_attention_stages(q, k, v, block_idx, block_size: int, scale: float | None = None,
                              *, block_sizes: BlockSizes | None = None,
                              interpret: bool = False) -> Stages:
    """The stages of `selected_attention`'s forward and backward for these shapes (the arrays
    are only read for their shapes and dtypes, and `block_idx` is bound into the stages)."""
    bs = _default_block_sizes(q, k, v, block_sizes)
    geo = dataclasses.replace(_validate(q, k, v, block_idx, block_size), split_dk=bs.split_dk)
    scale = 1.0 / math.sqrt(geo.d_k) if scale is None else float(scale)
    rest = (geo, scale, bs, interpret, False)
    chunk = _dkv_chunk(geo, bs)
    return Stages(
        forward=lambda q, k, v: _forward(q, k, v, block_idx, *rest),
        backward_dq=lambda q, k, v, do, lse, delta: _backward_dq(q, k, v, block_idx, do, lse,
                                                                 delta, *rest),
        inverse_index=lambda idx: _inverse_index(idx, geo, chunk,
                                                 pad=_dkv_rows(geo, bs) // geo.h),
        backward_dkv=lambda q, k, v, do, lse, delta: _backward_dkv(q, k, v, block_idx, do, lse,
                                                                   delta, *rest),
        dkv_work_items=_dkv_work_items(geo, chunk))


# ------------------------------------------------------------------------------------------------
# Reference and test inputs
# ------------------------------------------------------------------------------------------------

def selected_attention_reference(q, k, v, block_idx, block_size: int, scale: float | None = None,
                                 *, query_chunk: int | None = None):
    """Plain-JAX selected attention: gathers each query's selected keys, float32 softmax.

    Shapes as `selected_attention`. `query_chunk` processes the queries in chunks of that many
    (rematerialised in the backward pass) so long sequences fit in memory: the gathered keys of a
    chunk are `[B, chunk, G, n_sel * block_size, d]`.
    """
    geo = _validate(q, k, v, block_idx, block_size)
    B, T, H, G, h, n_sel, l_sel = geo.B, geo.T, geo.H, geo.G, geo.h, geo.n_sel, geo.l_sel
    scale = 1.0 / math.sqrt(geo.d_k) if scale is None else float(scale)
    batch = jnp.arange(B)[:, None, None, None]
    group = jnp.arange(G)[None, None, :, None]
    # float32 softmax (float64 inputs stay float64, for the brute-force comparison in tests).
    work = jnp.promote_types(q.dtype, jnp.float32)
    k32, v32 = k.astype(work), v.astype(work)

    def attend(q_c, idx_c, t_c):  # [B, C, H, d_k], [B, C, G, n_sel], [C]
        C = q_c.shape[1]
        pos = idx_c[..., None] * l_sel + jnp.arange(l_sel)                # [B, C, G, n_sel, l]
        keep = (idx_c[..., None] >= 0) & (pos <= t_c[None, :, None, None, None]) & (pos < T)
        pos = jnp.clip(pos, 0, T - 1).reshape(B, C, G, n_sel * l_sel)
        keep = keep.reshape(B, C, G, 1, n_sel * l_sel)
        k_c, v_c = k32[batch, pos, group], v32[batch, pos, group]         # [B, C, G, S, d]
        q_c = q_c.reshape(B, C, G, h, geo.d_k).astype(work)
        logits = jnp.einsum("bcghd,bcgsd->bcghs", q_c, k_c,
                            precision=lax.Precision.HIGHEST) * scale
        logits = jnp.where(keep, logits, -jnp.inf)
        any_key = jnp.any(keep, axis=-1, keepdims=True)
        weights = jax.nn.softmax(jnp.where(any_key, logits, 0.0), axis=-1) * any_key
        o = jnp.einsum("bcghs,bcgsd->bcghd", weights, v_c, precision=lax.Precision.HIGHEST)
        return o.reshape(B, C, H, geo.d_v).astype(q.dtype)

    t_all = jnp.arange(T, dtype=jnp.int32)
    if query_chunk is None or query_chunk >= T:
        return attend(q, block_idx, t_all)
    n_chunks = -(-T // query_chunk)
    T_pad = n_chunks * query_chunk
    chunks = lambda x: jnp.moveaxis(
        pad_axis(x, 1, T_pad).reshape(B, n_chunks, query_chunk, *x.shape[2:]), 1, 0)
    q_chunks = chunks(q)
    idx_chunks = chunks(pad_axis(block_idx, 1, T_pad, value=-1))
    t_chunks = pad_axis(t_all, 0, T_pad).reshape(n_chunks, query_chunk)
    o = lax.map(jax.checkpoint(lambda a: attend(*a)), (q_chunks, idx_chunks, t_chunks))
    return jnp.moveaxis(o, 0, 1).reshape(B, T_pad, H, geo.d_v)[:, :T]


def random_block_idx(key, B: int, T: int, G: int, n_sel: int, block_size: int, *,
                     n_init: int = 1, n_local: int = 2, query_chunk: int = 4096) -> jax.Array:
    """A random valid `block_idx int32 [B, T, G, n_sel]` in the spec's form (step 6).

    Query t's eligible blocks are 0 .. t // block_size. The first `n_init` and the `n_local` most
    recent eligible blocks are always chosen; the rest of the `n_sel` are drawn uniformly from
    the other eligible blocks. Ascending, padded at the end with -1 when fewer are eligible.
    Built `query_chunk` queries at a time, so T = 64k stays small in memory.
    """
    n_blocks = -(-T // block_size)
    k_top = min(n_sel, n_blocks)
    blocks = jnp.arange(n_blocks, dtype=jnp.int32)

    def chunk(args):
        key_c, t_c = args  # t_c [C]
        last = (t_c // block_size)[:, None]                           # [C, 1]
        eligible = blocks[None, :] <= last
        forced = (blocks[None, :] < n_init) | ((blocks[None, :] > last - n_local) & eligible)
        score = jax.random.uniform(key_c, (B, t_c.shape[0], G, n_blocks))
        score = jnp.where(forced[None, :, None, :], 2.0, score)
        score = jnp.where(eligible[None, :, None, :], score, -1.0)
        top_score, top = lax.top_k(score, k_top)
        top = jnp.where(top_score >= 0.0, top, n_blocks)              # ineligible -> sorts last
        top = jnp.sort(top, axis=-1)
        top = jnp.where(top == n_blocks, -1, top).astype(jnp.int32)
        return pad_axis(top, 3, n_sel, value=-1)

    C = min(query_chunk, T)
    n_chunks = -(-T // C)
    t_all = pad_axis(jnp.arange(T, dtype=jnp.int32), 0, n_chunks * C).reshape(n_chunks, C)
    out = lax.map(chunk, (jax.random.split(key, n_chunks), t_all))   # [n_chunks, B, C, G, n_sel]
    return jnp.moveaxis(out, 0, 1).reshape(B, n_chunks * C, G, n_sel)[:, :T]
