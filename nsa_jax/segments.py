"""Packed sequences with a traced `cu_seqlens`: per-token and per-compressed-slot bookkeeping.

`cu_seqlens int32 [N + 1]` packs N sequences into one row (`B = 1`). Every quantity the branches
need is derived here with fixed shapes, so `jax.jit` compiles once per `(T, N)`:
  - each token gets its sequence id, its local position and its sequence's first token;
  - compressed blocks are laid out per sequence in `T // d` slots: sequence n owns slots
    `[slot_offset[n], slot_offset[n + 1])`, slot c is local block `c - slot_offset[n]`, and
    the slots past the last sequence's blocks are unused (`cmp_seg = -1`). `T // d` suffices
    because a sequence of length L has `(L - l) // d + 1 <= L // d` blocks (l >= d).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, num_admissible_cmp_blocks


class Segments(NamedTuple):
    """Per-token `[T]` and per-compressed-slot `[C]` int32 arrays (a pytree)."""

    pos: jax.Array         # [T] position of the token inside its sequence
    seg: jax.Array         # [T] sequence id of the token
    start: jax.Array       # [T] global index of the first token of the token's sequence
    cmp_offset: jax.Array  # [T] first compressed slot of the token's sequence
    cmp_seg: jax.Array     # [C] sequence owning the slot, -1 for an unused slot
    cmp_local: jax.Array   # [C] local block index i of the slot inside its sequence
    cmp_start: jax.Array   # [C] global index of the slot's first token (0 for unused slots)

    @property
    def num_slots(self) -> int:
        return self.cmp_seg.shape[0]


def single_sequence(seq_len: int, n_cmp: int, cfg: NSAConfig) -> Segments:
    """The trivial layout: one sequence per batch row, compressed block i in slot i."""
    t = jnp.arange(seq_len, dtype=jnp.int32)
    zeros_t = jnp.zeros((seq_len,), jnp.int32)
    c = jnp.arange(n_cmp, dtype=jnp.int32)
    return Segments(pos=t, seg=zeros_t, start=zeros_t, cmp_offset=zeros_t,
                    cmp_seg=jnp.zeros((n_cmp,), jnp.int32), cmp_local=c,
                    cmp_start=c * cfg.cmp_stride)


def from_cu_seqlens(cu_seqlens: jax.Array, seq_len: int, cfg: NSAConfig) -> Segments:
    """cu_seqlens: int `[N + 1]`, `0 = cu[0] <= ... <= cu[N] = seq_len` (may be traced)."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    n_seqs = cu.shape[0] - 1
    l, d = cfg.cmp_block, cfg.cmp_stride
    t = jnp.arange(seq_len, dtype=jnp.int32)
    seg = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, n_seqs - 1).astype(jnp.int32)
    start = cu[seg]

    lengths = cu[1:] - cu[:-1]
    blocks_per_seq = num_admissible_cmp_blocks(lengths - 1, l, d)    # num_cmp_blocks, traced
    slot_offset = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                   jnp.cumsum(blocks_per_seq).astype(jnp.int32)])
    c = jnp.arange(seq_len // d, dtype=jnp.int32)
    # side="right" skips sequences without blocks (their offsets repeat the next one's).
    slot_seg = jnp.clip(jnp.searchsorted(slot_offset, c, side="right") - 1, 0, n_seqs - 1)
    used = c < slot_offset[n_seqs]
    local = c - slot_offset[slot_seg]
    return Segments(
        pos=t - start,
        seg=seg,
        start=start,
        cmp_offset=slot_offset[seg],
        cmp_seg=jnp.where(used, slot_seg, -1).astype(jnp.int32),
        cmp_local=jnp.where(used, local, 0).astype(jnp.int32),
        cmp_start=jnp.where(used, cu[slot_seg] + local * d, 0).astype(jnp.int32),
    )
