"""Isolation of non-finite values (NaN / inf) to the tokens that depend on them.

An attention kernel multiplies masked keys by a zero weight, and `0 * NaN = NaN`: one NaN at
token t of a sequence would then spoil every query of that sequence (causality broken) and, in
packed rows or padded tiles, other sequences too; in the backward pass, zero cotangents meet the
NaN the same way. Rather than trust every backend to avoid such products, `nsa_jax.dispatch`
runs each branch through the guard here, for every backend alike:

  1. inputs are *sanitized*: each non-finite element becomes 0, so the backend only ever sees
     finite values (and its backward only finite residuals);
  2. outputs are *poisoned*: a row that, by the branch's own mask, attends a key or value row
     holding a non-finite element, or whose query row holds one, becomes NaN (`where`, whose
     gradient to the finite path is 0).

So a non-finite value at token t changes nothing before t and nothing in another sequence, in
the forward and in the gradient of any loss over those outputs; the outputs that do depend on it
are NaN. The poison masks are O(T) bookkeeping (prefix counts of bad rows), not attention.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, num_admissible_cmp_blocks
from nsa_jax.segments import Segments, single_sequence


@jax.custom_vjp
def sanitize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x `[..., D]` -> (x with non-finite elements set to 0, bad `[...]`: row has one).

    The gradient passes to the rows without a non-finite element and is 0 on the others. Every
    output that reads a bad row is poisoned, so no loss over finite outputs sends such a row a
    cotangent; keeping only the row mask (not an elementwise one as `where`'s own gradient
    would) saves a `[..., D]` boolean: 0.75 GiB for q at 64k tokens x 64 heads x 192."""
    finite = jnp.isfinite(x)
    return jnp.where(finite, x, jnp.zeros((), x.dtype)), ~jnp.all(finite, axis=-1)


def _sanitize_fwd(x):
    out = sanitize(x)
    return out, out[1]


def _sanitize_bwd(bad, cotangents):
    dx, _ = cotangents
    return (jnp.where(bad[..., None], jnp.zeros((), dx.dtype), dx),)


sanitize.defvjp(_sanitize_fwd, _sanitize_bwd)


def poison(out: jax.Array, bad: jax.Array) -> jax.Array:
    """out `[..., D]` with the rows where bad `[...]` replaced by NaN."""
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, out.dtype), out)


def _prefix_count(bad: jax.Array) -> jax.Array:
    """bad bool `[B, S, G]` -> int32 `[B, S + 1, G]`: bad rows among the first s."""
    counts = jnp.cumsum(bad.astype(jnp.int32), axis=1, dtype=jnp.int32)
    return jnp.pad(counts, [(0, 0), (1, 0), (0, 0)])


def _count_in(prefix: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Bad rows in `[lo, hi)` (empty when hi <= lo). prefix `[B, S + 1, G]`; lo, hi int
    `[B, Q, G, ...]` -> int32 `[B, Q, G, ...]`."""
    S = prefix.shape[1] - 1
    lo, hi = jnp.clip(lo, 0, S), jnp.clip(hi, 0, S)
    hi = jnp.maximum(hi, lo)
    B, Q, G = lo.shape[:3]
    rest = lo.shape[3:]
    n = math.prod(rest)  # explicit sizes: a `-1` reshape fails on empty arrays (Q or C = 0)
    table = jnp.swapaxes(prefix, 1, 2)                                    # [B, G, S + 1]

    def take(idx):
        flat = jnp.swapaxes(idx.reshape(B, Q, G, n), 1, 2).reshape(B, G, Q * n)
        got = jnp.take_along_axis(table, flat, axis=2).reshape(B, G, Q, n)
        return jnp.swapaxes(got, 1, 2).reshape(B, Q, G, *rest)

    return take(hi) - take(lo)


def _query_bad(bad_q: jax.Array, n_groups: int) -> jax.Array:
    """bad_q `[B, T, H]` -> `[B, T, G, h]` (query head i belongs to group i // h)."""
    B, T, H = bad_q.shape
    return bad_q.reshape(B, T, n_groups, H // n_groups)


def _per_head(bad: jax.Array) -> jax.Array:
    """`[B, T, G, h]` -> `[B, T, H]`."""
    return bad.reshape(*bad.shape[:2], bad.shape[2] * bad.shape[3])  # no -1: B may be 0


def _kv_bad(k, v) -> tuple[jax.Array, jax.Array, jax.Array]:
    k, bad_k = sanitize(k)
    v, bad_v = sanitize(v)
    return k, v, bad_k | bad_v


def _positions(segments: Optional[Segments], B: int, T: int):
    """Per query `[B, T, 1]`: global index, local position, first token, first compressed slot."""
    t = jnp.arange(T, dtype=jnp.int32)
    if segments is None:
        pos, start, offset = t, jnp.zeros_like(t), jnp.zeros_like(t)
    else:
        pos, start, offset = segments.pos, segments.start, segments.cmp_offset

    def shaped(a):
        return jnp.broadcast_to(a.astype(jnp.int32)[None, :, None], (B, T, 1))

    return shaped(t), shaped(pos), shaped(start), shaped(offset)


def compress_kv(run: Callable, k, cmp_params, cfg: NSAConfig, *, segments=None, **kwargs):
    """A summary is poisoned when its block (the l tokens from its start) holds a bad row."""
    k_safe, bad = sanitize(k)
    out = run(k_safe, cmp_params, cfg, segments=segments, **kwargs)
    B, T, G, _ = k.shape
    C = out.shape[1]
    if segments is None:
        segments = single_sequence(T, C, cfg)
    start = jnp.broadcast_to(segments.cmp_start[None, :, None], (B, C, G))
    n_bad = _count_in(_prefix_count(bad), start, start + cfg.cmp_block)
    used = (segments.cmp_seg >= 0)[None, :, None]
    return poison(out, (n_bad > 0) & used)


def compressed_attention(run: Callable, q, k_cmp, v_cmp, cfg: NSAConfig, *, segments=None,
                         return_lse: bool = False, **kwargs):
    """Query t sees its sequence's slots `[offset, offset + n_visible(t))`, n_visible(t) the
    number of blocks i with `i*d + l - 1 <= t`."""
    q_safe, bad_q = sanitize(q)
    k_safe, v_safe, bad_kv = _kv_bad(k_cmp, v_cmp)
    out = run(q_safe, k_safe, v_safe, cfg, segments=segments, return_lse=return_lse, **kwargs)
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    _, pos, _, offset = _positions(segments, B, T)
    visible = num_admissible_cmp_blocks(pos, cfg.cmp_block, cfg.cmp_stride)
    n_bad = _count_in(_prefix_count(bad_kv), jnp.broadcast_to(offset, (B, T, G)),
                      jnp.broadcast_to(offset + visible, (B, T, G)))
    bad = _per_head((n_bad > 0)[..., None] | _query_bad(bad_q, G))
    if not return_lse:
        return poison(out, bad)
    o, lse = out
    return poison(o, bad), jnp.where(bad, jnp.asarray(jnp.nan, lse.dtype), lse)


def select_blocks(run: Callable, q, k_cmp, cfg: NSAConfig, *, lse=None, **kwargs):
    """block_idx is an integer: nothing to poison. A NaN lse (a poisoned row of the compressed
    branch) becomes +inf, so the backend sees finite scores `exp(s - lse) = 0` there; such a
    row's output is NaN anyway."""
    q_safe, _ = sanitize(q)
    k_safe, _ = sanitize(k_cmp)
    if lse is not None:
        lse = jnp.where(jnp.isnan(lse), jnp.asarray(jnp.inf, lse.dtype), lse)
        kwargs["lse"] = lse
    return run(q_safe, k_safe, cfg, **kwargs)


def selected_attention(run: Callable, q, k, v, block_idx, *, block_size: int, segments=None,
                       **kwargs):
    """Query t sees, of each selected block j >= 0, the tokens `[start + j*l, start + j*l + l)`
    that are `<= t`."""
    q_safe, bad_q = sanitize(q)
    k_safe, v_safe, bad_kv = _kv_bad(k, v)
    out = run(q_safe, k_safe, v_safe, block_idx, block_size=block_size, segments=segments,
              **kwargs)
    B, T, H, _ = q.shape
    G = k.shape[2]
    t, _, start, _ = _positions(segments, B, T)
    lo = start[..., None] + block_idx * block_size                       # [B, T, G, n]
    hi = jnp.minimum(lo + block_size, t[..., None] + 1)
    n_bad = jnp.where(block_idx >= 0, _count_in(_prefix_count(bad_kv), lo, hi), 0)
    return poison(out, _per_head((jnp.sum(n_bad, axis=-1) > 0)[..., None]
                                 | _query_bad(bad_q, G)))


def sliding_window_attention(run: Callable, q, k, v, *, window: int, segments=None,
                             **kwargs):
    """Query t sees `[max(start, t - w + 1), t]`."""
    q_safe, bad_q = sanitize(q)
    k_safe, v_safe, bad_kv = _kv_bad(k, v)
    out = run(q_safe, k_safe, v_safe, window=window, segments=segments, **kwargs)
    B, T, H, _ = q.shape
    G = k.shape[2]
    t, _, start, _ = _positions(segments, B, T)
    lo = jnp.broadcast_to(jnp.maximum(start, t - window + 1), (B, T, G))
    n_bad = _count_in(_prefix_count(bad_kv), lo, jnp.broadcast_to(t + 1, (B, T, G)))
    return poison(out, _per_head((n_bad > 0)[..., None] | _query_bad(bad_q, G)))


def unguarded(run: Callable, *args, **kwargs):
    """The decode entries run unguarded: the rows of a cache are separate sequences, which no
    entry mixes, so a NaN stays in its row; within the row a later step may see it even where
    its masks exclude it (docs/ROBUSTNESS.md)."""
    return run(*args, **kwargs)


GUARDS = {
    "compress_kv": compress_kv,
    "compressed_attention": compressed_attention,
    "select_blocks": select_blocks,
    "selected_attention": selected_attention,
    "sliding_window_attention": sliding_window_attention,
    # The alignment loss's target: its inputs are the layer's own projections, and a
    # non-finite one makes that query's KL non-finite, which the loss reports as it is.
    "selected_block_mass": unguarded,
    "selected_importance": unguarded,
    "decode_append": unguarded,
    "decode_compressed_attention": unguarded,
    "decode_select_blocks": unguarded,
    "decode_compressed_select": unguarded,
    "decode_selected_window_attention": unguarded,
    "decode_attention": unguarded,
    "decode_compress": unguarded,
}
