"""The top-n pieces of the selection kernels, in registers: the fused prefill selection's
running top-n (`select_blocks`) and its ascending output, and the ascending output of the top-n
kernel (which decode ranks with too) by rank. Only reductions (max, min, sum), `where` and iota
comparisons, all of which the Triton lowering supports; the order is the spec's (higher score
first, the lower index on equal scores)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# An index larger than any block index: marks empty slots of the running top-n.
NO_BLOCK = 2 ** 30


def empty_top(rows: int, n_sel: int, n_sel_pad: int):
    """An empty running top set `(values, indices)` of `[rows, n_sel_pad]` slots for `insert_top`:
    distinct indices `NO_BLOCK + slot`, worse than any block; values `-inf`, except the slots past
    `n_sel` (n_sel padded to a power of two), which hold `+inf` so that they are never the worst
    member (the only `+inf` candidates are forced blocks, at most n_sel of them)."""
    slot = lax.broadcasted_iota(jnp.int32, (rows, n_sel_pad), 1)
    return jnp.where(slot < n_sel, -jnp.inf, jnp.inf).astype(jnp.float32), NO_BLOCK + slot


def insert_top(top_val, top_idx, score, index):
    """Fold a step's candidates `(score, index) [R, S]` into the running top set
    `(top_val, top_idx) [R, K]` (unsorted, K = n_sel slots).

    The order is the spec's: higher score first, on equal scores the lower index. Each round
    takes every row's best remaining candidate and, where it beats the row's worst member, puts
    it in that member's slot. A row is done as soon as its best candidate does not beat its worst
    member (later candidates are worse, the worst member only gets better), so the rounds number
    one more than the most insertions of any row: usually one or two once the set is full.
    Empty slots hold `(-inf, NO_BLOCK + slot)`: distinct, and worse than any block. `-inf`
    candidates (ineligible blocks) never enter."""

    def insert(carry):
        top_val, top_idx, score, _ = carry
        best = score.max(axis=1)
        pick = jnp.where(score == best[:, None], index, NO_BLOCK).min(axis=1)
        worst = top_val.min(axis=1)
        worst_idx = jnp.where(top_val == worst[:, None], top_idx, -1).max(axis=1)
        better = (best > worst) | ((best == worst) & (pick < worst_idx))
        better = better & (best > -jnp.inf)
        replace = better[:, None] & (top_idx == worst_idx[:, None])
        top_val = jnp.where(replace, best[:, None], top_val)
        top_idx = jnp.where(replace, pick[:, None], top_idx)
        score = jnp.where(better[:, None] & (index == pick[:, None]), -jnp.inf, score)
        return top_val, top_idx, score, better.astype(jnp.int32).max()

    top_val, top_idx, _, _ = lax.while_loop(lambda carry: carry[3] > 0, insert,
                                            (top_val, top_idx, score, jnp.int32(1)))
    return top_val, top_idx


def ascending_by_rank(top_idx):
    """`top_idx [R, K]` (distinct block indices, or NO_BLOCK, which may repeat) in ascending
    order, empty slots -> -1: `ascending` without its serial rounds. Each slot counts the slots
    that sort before it (a smaller index, or an equal one in an earlier slot) and lands at that
    rank, in two `[R, K, K]` comparisons."""
    a, b = top_idx[:, :, None], top_idx[:, None, :]
    shape = (1,) + top_idx.shape[1:] * 2
    mine = lax.broadcasted_iota(jnp.int32, shape, 1)
    other = lax.broadcasted_iota(jnp.int32, shape, 2)
    before = (b < a) | ((b == a) & (other < mine))
    rank = jnp.sum(before.astype(jnp.int32), axis=2)                          # [R, K]
    out = jnp.sum(jnp.where(rank[:, :, None] == other, a, 0), axis=1)         # [R, K]
    return jnp.where(out >= NO_BLOCK, -1, out)


def ascending(top_idx, n_sel: int):
    """The `n_sel` smallest of `top_idx [R, K]` in ascending order; empty slots -> -1."""
    column = lax.broadcasted_iota(jnp.int32, top_idx.shape, 1)

    def extract(slot, carry):
        rest, out = carry
        smallest = rest.min(axis=1)
        out = jnp.where(column == slot, smallest[:, None], out)
        rest = jnp.where(rest == smallest[:, None], NO_BLOCK, rest)
        return rest, out

    _, out = lax.fori_loop(0, n_sel, extract,
                           (top_idx, jnp.full(top_idx.shape, NO_BLOCK, jnp.int32)))
    return jnp.where(out >= NO_BLOCK, -1, out)
