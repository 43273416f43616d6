"""Per-block attention mass of NSA's selected branch, as a Pallas GPU kernel (forward only).

For query t and KV group g with selected blocks `block_idx[b, t, g, :]`, the selected branch
(spec step 7) gives each query head a softmax over the tokens of those blocks that are `<= t`.
This kernel returns, per selected slot i, the natural log of that softmax's mass on block
`block_idx[..., i]`, summed over the group's heads:

    log_mass[b, t, g, i] = log sum_h sum_{s in block i, s <= t} softmax_h(q_t k_s * scale)[s]

(`-inf` for a `-1` slot or a block with no token `<= t`). The selection-alignment loss
(`nsa_jax.alignment`, sparse mode) takes it as its target; nothing differentiates it.

One program per (token, KV head, batch), as the selected forward (`selected_attention`): it
loads the group's `h` query heads once, walks the token's slots, loads each block's keys (never
the values), and keeps each head's log-sum-exp per slot in registers, `[h_pad, n_sel_pad]`
float32. At the end it normalises per head and sums the heads per slot, in the log2 domain.
It reads half the bytes of the selected forward and does half its products.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (LN_2, LOG2_E, MASK, check_implementation, check_kernel_dtype,
                                    dot_parts, load_cols, pad_axis, pallas_call)
from pallas_kernels.selected_attention import (BlockSizes, _default_block_sizes, _dot,
                                               _group_rows, _validate, _visit_bound)

__all__ = ["selected_block_mass", "selected_block_mass_reference"]

# A log2 value at or below this is "no mass" (MASK marks masked scores; sums of 2^MASK vanish).
_EMPTY = 0.5 * MASK


def _log2_sum_exp2(x, axis: int):
    """log2(sum(2^x)) over `axis` for x that is finite, with `MASK`-like entries contributing 0;
    `MASK` where every entry is empty."""
    m = jnp.max(x, axis=axis)
    total = jnp.sum(jnp.exp2(x - jnp.expand_dims(m, axis)), axis=axis)
    return jnp.where(m > _EMPTY, m + jnp.log2(total), MASK)


def _block_mass_kernel(q_ref, k_ref, idx_ref, out_ref, *, scale, l_sel, tile, parts, heads):
    """One (token t, KV head g, batch b). q_ref [h_pad, dk_pad], k_ref [T_pad, dk_pad],
    idx_ref [n_sel_pad]; out_ref [n_sel_pad] (natural log of each slot's mass)."""
    t = pl.program_id(0)
    q = load_cols(q_ref, (), parts)
    rows, n_slots = q_ref.shape[0], out_ref.shape[0]
    scale_log2 = scale * LOG2_E
    slot_ids = lax.broadcasted_iota(jnp.int32, (1, n_slots), 1)
    offset = lax.broadcasted_iota(jnp.int32, (1, tile), 1)

    def visit(slot, block_lse):
        j = idx_ref[slot]
        live = (j >= 0) & (j * l_sel <= t)
        start = jnp.where(live, j, 0) * l_sel
        k = load_cols(k_ref, (pl.ds(start, tile),), parts)
        keep = live & (start + offset <= t) & (offset < l_sel)
        s = jnp.where(keep, dot_parts(q, k, _dot) * scale_log2, MASK)         # [h_pad, tile]
        return jnp.where(slot_ids == slot, _log2_sum_exp2(s, 1)[:, None], block_lse)

    block_lse = lax.fori_loop(0, _visit_bound(idx_ref), visit,
                              jnp.full((rows, n_slots), MASK, jnp.float32))
    # Each head's softmax over all its selected tokens, then the heads summed per slot; padded
    # head rows (zero queries) are left out.
    head_lse = _log2_sum_exp2(block_lse, 1)                                    # [h_pad]
    real = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < heads
    share = jnp.where(real & (block_lse > _EMPTY) & (head_lse[:, None] > _EMPTY),
                      block_lse - head_lse[:, None], MASK)
    mass_log2 = _log2_sum_exp2(share, 0)                                       # [n_sel_pad]
    out_ref[...] = jnp.where(mass_log2 > _EMPTY, mass_log2 * LN_2, -jnp.inf)


def selected_block_mass(q, k, block_idx, block_size: int, scale: float | None = None, *,
                        block_sizes: BlockSizes | None = None, interpret: bool = False,
                        implementation: str = "triton"):
    """The log attention mass of each selected slot, summed over the group's heads (module
    docstring).

    Args:
      q: `[B, T, H, d_k]`; k: `[B, T, G, d_k]`, one float dtype (float16, bfloat16, float32).
      block_idx: int `[B, T, G, n_sel]`, as `selected_attention` takes it (-1 padded).
      block_size: l_sel; scale: softmax scale (`1/sqrt(d_k)` when None).
      block_sizes: the selected kernels' launch parameters (their forward's warps and stages;
        None: this architecture's, `pallas_kernels.profiles`).
      interpret: Pallas interpret mode (CPU tests).
      implementation: "triton" (Pallas Triton lowering) or "xla" (the reference).

    Raises NotImplementedError for float64 and head dims without tiles (as `selected_attention`).

    Returns:
      float32 `[B, T, G, n_sel]`, natural log; `-inf` where a slot holds no attended token.
      Not differentiable (a stop-gradient target).
    """
    check_implementation(implementation)
    _validate(q, k, k, block_idx, block_size)
    if implementation == "xla":
        return lax.stop_gradient(selected_block_mass_reference(q, k, block_idx, block_size, scale))
    check_kernel_dtype("selected_block_mass", q.dtype)
    block_sizes = _default_block_sizes(q, k, k, block_sizes)
    return _block_mass_jit(q, k, block_idx, block_size, scale, block_sizes, interpret)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _block_mass_jit(q, k, block_idx, block_size, scale, bs: BlockSizes, interpret: bool):
    geo = _validate(q, k, k, block_idx, block_size)
    geo = dataclasses.replace(geo, split_dk=bs.split_dk)
    scale = 1.0 / math.sqrt(geo.d_k) if scale is None else float(scale)
    if geo.B == 0:
        return jnp.zeros((0, geo.T, geo.G, geo.n_sel), jnp.float32)
    q, k, block_idx = (lax.stop_gradient(a) for a in (q, k, block_idx))
    qg = _group_rows(q, geo, geo.dk_pad)
    kp = pad_axis(pad_axis(k, 1, geo.T_pad), 3, geo.dk_pad)
    idx = pad_axis(block_idx.astype(jnp.int32), 3, geo.n_sel_pad, value=-1)
    kernel = functools.partial(_block_mass_kernel, scale=scale, l_sel=geo.l_sel, tile=geo.tile,
                               parts=geo.dk_parts, heads=geo.h)
    per_token = lambda shape: pl.BlockSpec(  # noqa: E731
        (None, None, None) + shape, lambda t, g, b: (b, t, g) + (0,) * len(shape))
    out = pallas_call(
        kernel, name="nsa_selected_block_mass", num_warps=bs.num_warps_fwd,
        num_stages=bs.num_stages_fwd, interpret=interpret,
        grid=(geo.T, geo.G, geo.B),
        in_specs=[per_token((geo.h_pad, geo.dk_pad)),
                  pl.BlockSpec((None, geo.T_pad, None, geo.dk_pad), lambda t, g, b: (b, 0, g, 0)),
                  per_token((geo.n_sel_pad,))],
        out_specs=per_token((geo.n_sel_pad,)),
        out_shape=jax.ShapeDtypeStruct((geo.B, geo.T, geo.G, geo.n_sel_pad), jnp.float32),
    )(qg, kp, idx)
    return out[..., :geo.n_sel]


def selected_block_mass_reference(q, k, block_idx, block_size: int, scale: float | None = None):
    """Plain JAX, the whole `[B, T, G, h, n_sel, l_sel]` score tensor at once (tests and small
    inputs): float32, or float64 for float64 inputs."""
    geo = _validate(q, k, k, block_idx, block_size)
    B, T, G, h, l_sel = geo.B, geo.T, geo.G, geo.h, geo.l_sel
    scale = 1.0 / math.sqrt(geo.d_k) if scale is None else float(scale)
    work = jnp.promote_types(q.dtype, jnp.float32)
    pos = block_idx[..., None] * l_sel + jnp.arange(l_sel)                    # [B, T, G, n, l]
    keep = ((block_idx[..., None] >= 0) & (pos <= jnp.arange(T)[None, :, None, None, None])
            & (pos < T))
    keys = k.astype(work)[jnp.arange(B)[:, None, None, None, None], jnp.clip(pos, 0, T - 1),
                          jnp.arange(G)[None, None, :, None, None]]          # [B, T, G, n, l, d]
    qg = q.astype(work).reshape(B, T, G, h, geo.d_k)
    s = jnp.einsum("btghd,btgnld->btghnl", qg, keys, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(keep[:, :, :, None], s, -jnp.inf)
    head_lse = jax.nn.logsumexp(s, axis=(-2, -1), keepdims=True)
    head_lse = jnp.where(jnp.isfinite(head_lse), head_lse, 0.0)
    return jax.nn.logsumexp(jax.nn.logsumexp(s - head_lse, axis=-1), axis=3)
