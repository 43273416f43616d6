"""NSA's block importance at the selected blocks, as Pallas GPU kernels (forward and backward).

The selection-alignment loss (`nsa_jax.alignment`, sparse mode) needs, for query t and KV
group g, the log of the spec's group importance (docs/NSA_SPEC.md, step 6) at each selected
block j = `blocks[b, t, g, i]`:

    log_s[b, t, g, i] = log sum_h sum_m w_m exp(q_{t,h} . k_cmp[j*r + m] * scale - lse[t, h])

over the group's h query heads and the compressed blocks `j*r + m` that overlap block j
(`nsa_common.overlap_by_offset`: offsets m, weights w_m; r = l_sel / d), each one admissible
(`c*d + l - 1 <= t`, inside `[0, C)`); lse is the compressed attention's log normaliser per
query and head. `-inf` where no admissible compressed block overlaps j, j is -1, or every lse
of the group is -inf. `nsa_jax.alignment.log_importance_at` computes the same in XLA from one
`[T, H, C]` product per chunk of queries (O(T^2 / d) work); these kernels read only the
compressed keys that overlap the selected blocks: O(T n_sel M) work.

Forward: one program per (token, KV head, batch). It loads the group's query heads and their
lse once, then per selected slot the 16 compressed keys from the first overlapping one (a
contiguous slice of k_cmp: the overlap offsets are consecutive), and reduces their scores with
a log-sum-exp over heads and offsets, in the log2 domain (the relative importance of blocks
whose probabilities are far below float32's range survives).

Backward: the same programs, with the slot's log_s as its normaliser: P = the share of each
(head, offset) term in the slot's sum, `G_i P` (G: the cotangent of log_s) gives dq (scale * G P
k, per token, written once), dlse (-sum of G P over the slot's offsets) and dk_cmp (scale *
(G P)^T q), which many tokens share: added with float32 atomics into a zeroed accumulator, so
its summation order (and its last bits) varies from run to run.

Lowering: the Pallas Triton lowering (`implementation="triton"`); `"xla"` runs
`selected_importance_reference`, the plain-JAX form the tests compare with the kernels in
interpret mode. Sequences one per batch row (packed sequences: the XLA form in the loss).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (LN_2, LOG2_E, MASK, check_implementation, check_kernel_dtype,
                                    dot, matmul_dim, pad_axis, pallas_call)

__all__ = ["selected_importance", "selected_importance_reference", "TILE"]

TILE = 16            # compressed keys loaded per selected block (the overlap offsets fit in it)
_EMPTY = 0.5 * MASK  # a log2 value at or below this is "no mass"
_NUM_WARPS, _NUM_STAGES = 4, 1


def _log2_sum_exp2_all(x):
    """log2(sum(2^x)) over every entry of a 2-D x; MASK where all are empty."""
    m = jnp.max(x)
    total = jnp.sum(jnp.exp2(x - m))
    return jnp.where(m > _EMPTY, m + jnp.log2(total), MASK)


def _slot_terms(t, j, q, lse2, k_ref, *, r, offsets, log2_w, cmp_block, cmp_stride, n_cmp,
                scale_log2):
    """The log2 terms `[h_pad, TILE]` of selected block j for token t (MASK where a term is not
    part of the sum), the tile's first compressed slot, and its keys `[TILE, dk_pad]`."""
    live = j >= 0
    first = jnp.where(live, j, 0) * r
    start = jnp.clip(first + offsets[0], 0, k_ref.shape[0] - TILE)
    k = k_ref[pl.ds(start, TILE), :]
    c = start + lax.broadcasted_iota(jnp.int32, (1, TILE), 1)
    m = c - first
    weight = jnp.full((1, TILE), MASK, jnp.float32)
    for offset, lw in zip(offsets, log2_w):
        weight = jnp.where(m == offset, jnp.float32(lw), weight)
    ok = (live & (weight > _EMPTY) & (c >= 0) & (c < n_cmp)
          & (c * cmp_stride + cmp_block - 1 <= t))
    s = dot(q, k, trans_b=True) * scale_log2
    terms = jnp.where(ok & (lse2[:, None] > _EMPTY), s - lse2[:, None] + weight, MASK)
    return terms, start, k


def _fwd_kernel(q_ref, lse_ref, idx_ref, k_ref, out_ref, *, n_slots, **geo):
    """One (token t, KV head g, batch b). q_ref [h_pad, dk_pad], lse_ref [h_pad] (log2; MASK for
    -inf and padded heads), idx_ref [K_pad], k_ref [C_pad, dk_pad]; out_ref [K_pad] (natural
    log, -inf for none)."""
    t = pl.program_id(0)
    q, lse2 = q_ref[...], lse_ref[...]
    slot_ids = lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)

    def visit(i, acc):
        terms, _, _ = _slot_terms(t, idx_ref[i], q, lse2, k_ref, **geo)
        return jnp.where(slot_ids == i, _log2_sum_exp2_all(terms), acc)

    acc = lax.fori_loop(0, n_slots, visit, jnp.full(out_ref.shape, MASK, jnp.float32))
    out_ref[...] = jnp.where(acc > _EMPTY, acc * LN_2, -jnp.inf)


def _bwd_kernel(q_ref, lse_ref, idx_ref, k_ref, out_ref, g_ref, dk_in_ref, dq_ref, dlse_ref,
                dk_ref, *, n_slots, scale, **geo):
    """The forward's program, backward. out_ref, g_ref [K_pad]: log_s (natural) and its
    cotangent; dq_ref [h_pad, dk_pad], dlse_ref [h_pad] (natural units); dk_ref [C_pad, dk_pad]
    float32, the shared accumulator (aliased to dk_in_ref), added to atomically."""
    del dk_in_ref
    t = pl.program_id(0)
    q, lse2 = q_ref[...], lse_ref[...]
    qf = q.astype(jnp.float32)
    slot_ids = lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    norm = out_ref[...] * LOG2_E
    grad = g_ref[...]

    def visit(i, carry):
        dq, dlse = carry
        terms, start, k = _slot_terms(t, idx_ref[i], q, lse2, k_ref, **geo)
        pick = slot_ids == i
        norm_i = jnp.sum(jnp.where(pick, norm, 0.0))
        g_i = jnp.sum(jnp.where(pick, grad, 0.0))
        live = (norm_i > _EMPTY) & (terms > _EMPTY)
        gp = jnp.where(live, g_i * jnp.exp2(terms - norm_i), 0.0)             # [h_pad, TILE]
        dq = dq + dot(gp, k.astype(jnp.float32)) * scale
        dlse = dlse - jnp.sum(gp, axis=1)
        pltriton.atomic_add(dk_ref, (pl.ds(start, TILE), pl.ds(jnp.int32(0), dk_ref.shape[1])),
                            dot(gp, qf, trans_a=True) * scale)
        return dq, dlse

    dq, dlse = lax.fori_loop(0, n_slots, visit,
                             (jnp.zeros(dq_ref.shape, jnp.float32),
                              jnp.zeros(dlse_ref.shape, jnp.float32)))
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dlse_ref[...] = dlse


def _geometry(q, k_cmp, blocks):
    B, T, H, dk = q.shape
    G, C = k_cmp.shape[2], k_cmp.shape[1]
    h = H // G
    return dict(B=B, T=T, H=H, G=G, h=h, C=C, K=blocks.shape[-1], h_pad=matmul_dim(h),
                dk=dk, dk_pad=matmul_dim(dk), C_pad=max(TILE, -(-C // TILE) * TILE),
                K_pad=max(2, 1 << (blocks.shape[-1] - 1).bit_length()))


def _check(q, k_cmp, lse, blocks, cmp_block, cmp_stride, sel_block, weights):
    if q.ndim != 4 or k_cmp.ndim != 4 or lse.ndim != 3 or blocks.ndim != 4:
        raise ValueError(f"selected_importance takes q [B, T, H, d_k], k_cmp [B, C, G, d_k], lse "
                         f"[B, T, H] and blocks [B, T, G, K]; got {q.shape}, {k_cmp.shape}, "
                         f"{lse.shape}, {blocks.shape}")
    B, T, H, dk = q.shape
    G = k_cmp.shape[2]
    if (k_cmp.shape[0] != B or k_cmp.shape[3] != dk or H % G or lse.shape != (B, T, H)
            or blocks.shape[:3] != (B, T, G)):
        raise ValueError(f"selected_importance: shapes do not agree: q {q.shape}, k_cmp "
                         f"{k_cmp.shape}, lse {lse.shape}, blocks {blocks.shape}")
    if sel_block % cmp_stride:
        raise ValueError(f"sel_block ({sel_block}) must be a multiple of cmp_stride "
                         f"({cmp_stride})")
    offsets = [m for m, _ in weights]
    if offsets != list(range(offsets[0], offsets[0] + len(offsets))) or len(offsets) > TILE:
        raise NotImplementedError(f"selected_importance needs at most {TILE} consecutive overlap "
                                  f"offsets, got {offsets}")


def selected_importance(q, k_cmp, lse, blocks, *, cmp_block: int, cmp_stride: int,
                        sel_block: int, weights, scale: float, interpret: bool = False,
                        implementation: str = "triton"):
    """log_s (module docstring): the log group importance of each selected block.

    Args:
      q: `[B, T, H, d_k]`; k_cmp: `[B, C, G, d_k]` (one sequence per row), one float dtype.
      lse: `[B, T, H]`, the compressed attention's natural log normaliser (-inf: none).
      blocks: int `[B, T, G, K]`, local selection blocks (-1: none).
      cmp_block, cmp_stride, sel_block: l, d, l_sel; weights: `overlap_by_offset(cfg)`.
      scale: the softmax scale; interpret: Pallas interpret mode (CPU tests);
      implementation: "triton" (the kernels) or "xla" (`selected_importance_reference`).

    Returns float32 `[B, T, G, K]`, differentiable in q, k_cmp and lse.
    """
    check_implementation(implementation)
    weights = tuple((int(m), float(w)) for m, w in weights)
    _check(q, k_cmp, lse, blocks, cmp_block, cmp_stride, sel_block, weights)
    if implementation == "xla":
        return selected_importance_reference(q, k_cmp, lse, blocks, cmp_block=cmp_block,
                                             cmp_stride=cmp_stride, sel_block=sel_block,
                                             weights=weights, scale=scale)
    check_kernel_dtype("selected_importance", q.dtype)
    return _importance(q, k_cmp, lse.astype(jnp.float32), blocks.astype(jnp.int32),
                       (cmp_block, cmp_stride, sel_block, weights, float(scale), interpret))


def _prepare(q, k_cmp, lse, blocks, statics):
    cmp_block, cmp_stride, sel_block, weights, scale, interpret = statics
    geo = _geometry(q, k_cmp, blocks)
    B, T, G, h = geo["B"], geo["T"], geo["G"], geo["h"]
    qg = q.reshape(B, T, G, h, geo["dk"])
    qg = pad_axis(pad_axis(qg, 3, geo["h_pad"]), 4, geo["dk_pad"])
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2_E, MASK).reshape(B, T, G, h)
    lse2 = pad_axis(lse2, 3, geo["h_pad"], value=MASK)
    kp = pad_axis(pad_axis(k_cmp, 1, geo["C_pad"]), 3, geo["dk_pad"])
    idx = pad_axis(blocks, 3, geo["K_pad"], value=-1)
    kernel_geo = dict(n_slots=geo["K"], r=sel_block // cmp_stride,
                      offsets=tuple(m for m, _ in weights),
                      log2_w=tuple(math.log2(w) for _, w in weights), cmp_block=cmp_block,
                      cmp_stride=cmp_stride, n_cmp=geo["C"], scale_log2=scale * LOG2_E)
    row = lambda *shape: pl.BlockSpec(  # noqa: E731
        (None, None, None) + shape, lambda t, g, b: (b, t, g) + (0,) * len(shape))
    whole = pl.BlockSpec((None, geo["C_pad"], None, geo["dk_pad"]),
                         lambda t, g, b: (b, 0, g, 0))
    return geo, (qg, lse2, idx, kp), kernel_geo, row, whole, scale, interpret


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _importance(q, k_cmp, lse, blocks, statics):
    return _importance_fwd(q, k_cmp, lse, blocks, statics)[0]


def _importance_fwd(q, k_cmp, lse, blocks, statics):
    geo, args, kernel_geo, row, whole, _, interpret = _prepare(q, k_cmp, lse, blocks, statics)
    out = pallas_call(
        functools.partial(_fwd_kernel, **kernel_geo), name="nsa_selected_importance",
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, interpret=interpret,
        grid=(geo["T"], geo["G"], geo["B"]),
        in_specs=[row(geo["h_pad"], geo["dk_pad"]), row(geo["h_pad"]), row(geo["K_pad"]), whole],
        out_specs=row(geo["K_pad"]),
        out_shape=jax.ShapeDtypeStruct((geo["B"], geo["T"], geo["G"], geo["K_pad"]), jnp.float32),
    )(*args)
    return out[..., :geo["K"]], (q, k_cmp, lse, blocks, out)


def _importance_bwd(statics, residuals, g):
    q, k_cmp, lse, blocks, out = residuals
    geo, args, kernel_geo, row, whole, scale, interpret = _prepare(q, k_cmp, lse, blocks, statics)
    B, T, G = geo["B"], geo["T"], geo["G"]
    g = pad_axis(jnp.where(jnp.isfinite(out[..., :geo["K"]]), g, 0.0).astype(jnp.float32), 3,
                 geo["K_pad"])
    dk0 = jnp.zeros((B, geo["C_pad"], G, geo["dk_pad"]), jnp.float32)
    dq, dlse, dk = pallas_call(
        functools.partial(_bwd_kernel, scale=scale, **kernel_geo),
        name="nsa_selected_importance_bwd", num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        interpret=interpret, grid=(T, G, B),
        in_specs=[row(geo["h_pad"], geo["dk_pad"]), row(geo["h_pad"]), row(geo["K_pad"]), whole,
                  row(geo["K_pad"]), row(geo["K_pad"]), whole],
        out_specs=[row(geo["h_pad"], geo["dk_pad"]), row(geo["h_pad"]), whole],
        out_shape=[jax.ShapeDtypeStruct((B, T, G, geo["h_pad"], geo["dk_pad"]), jnp.float32),
                   jax.ShapeDtypeStruct((B, T, G, geo["h_pad"]), jnp.float32),
                   jax.ShapeDtypeStruct(dk0.shape, jnp.float32)],
        input_output_aliases={6: 2},
    )(*args, out, g, dk0)
    h, dk_dim = geo["h"], geo["dk"]
    dq = dq[:, :, :, :h, :dk_dim].reshape(q.shape).astype(q.dtype)
    dlse = jnp.where(jnp.isfinite(lse), dlse[..., :h].reshape(lse.shape), 0.0)
    dk = dk[:, :geo["C"], :, :dk_dim].astype(k_cmp.dtype)
    return dq, dk, dlse.astype(lse.dtype), None


_importance.defvjp(_importance_fwd, _importance_bwd)


def selected_importance_reference(q, k_cmp, lse, blocks, *, cmp_block: int, cmp_stride: int,
                                  sel_block: int, weights, scale: float):
    """Plain JAX (tests, small inputs): the overlapping compressed keys gathered per (token,
    group, slot); float32, float64 for float64 inputs."""
    B, T, H, dk = q.shape
    C, G = k_cmp.shape[1], k_cmp.shape[2]
    h = H // G
    work = jnp.promote_types(q.dtype, jnp.float32)
    r = sel_block // cmp_stride
    m = jnp.asarray([o for o, _ in weights], jnp.int32)
    log_w = jnp.asarray([math.log(w) for _, w in weights], work)
    c = blocks[..., None] * r + m                                               # [B, T, G, K, M]
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None, None, None]
    ok = (blocks[..., None] >= 0) & (c >= 0) & (c < C) & (c * cmp_stride + cmp_block - 1 <= t)
    keys = k_cmp.astype(work)[jnp.arange(B)[:, None, None, None, None], jnp.clip(c, 0, C - 1),
                              jnp.arange(G)[None, None, :, None, None]]        # [B,T,G,K,M,d]
    qg = q.astype(work).reshape(B, T, G, h, dk)
    s = jnp.einsum("btghd,btgkmd->btghkm", qg, keys, precision=lax.Precision.HIGHEST) * scale
    lse = lse.astype(work).reshape(B, T, G, h)
    finite = jnp.isfinite(lse)
    terms = s - jnp.where(finite, lse, 0.0)[..., None, None] + log_w
    keep = ok[:, :, :, None] & finite[..., None, None]
    terms = jnp.where(keep, terms, -jnp.inf)
    peak = jnp.max(terms, axis=(3, 5), keepdims=True)
    peak = lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(jnp.where(keep, jnp.exp(terms - peak), 0.0), axis=(3, 5))
    return jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + peak[:, :, :, 0, :, 0],
                     -jnp.inf)
