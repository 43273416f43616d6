"""Selection alignment: a loss that trains NSA's block ranking towards the layer's own attention.

NSA picks the `n_sel` blocks of highest importance (docs/NSA_SPEC.md, step 6), computed from the
compressed attention. The pick is not differentiable, so the language-model loss never tells the
compressed keys which block held what the query needed. This objective does, as DeepSeek-V3.2's
sparse attention trains its indexer: a KL divergence towards the distribution of the attention
the selection stands in for, that attention held fixed (stop-gradient).

For query t (local position) and KV group g, over the candidate blocks J (below):

    p[j]      = s[t, g, j] / sum_J s      s: the spec's group importance (step 6: p_cmp through
                                          the overlap weights, summed over the group's h heads)
    target[j] = m[t, g, j] / sum_J m      m: the attention of the selected branch (queries q,
                                          keys k_sel, the layer's scale, causal), each head's
                                          probabilities summed over block j's tokens, summed
                                          over the group's heads
    kl[t, g]  = KL(target || p~),  p~ = (p + eps) / (1 + |J| eps)

`selection_alignment_loss` returns the mean of kl over the (query, group) pairs with a non-empty J.

Candidates J. `mode="dense"`: the eligible blocks that are not forced,
`n_init <= j <= t // l_sel - n_local`; m is the full causal attention (every head normalised over
all tokens `<= t`). `mode="sparse"`: the blocks of the layer's selection (`block_idx`) that are not
forced; m is the selected branch's own attention (normalised over the tokens of all selected
blocks, forced ones included), as the layer computes it. Forced blocks (the first `n_init` and the
`n_local` most recent) are attended whatever the scores say, so there is nothing to rank: both
distributions drop them and renormalise over the rest. A query with no candidate (early tokens,
or `n_sel == n_init + n_local` in sparse mode) is left out of the mean.

Gradient. The target is under stop-gradient, and so is the layer's input x (the objective trains
this layer's ranking, never the layers below). The gradient reaches the compressed keys: the key
projection `wk["cmp"]` (`wk["shared"]` with `shared_kv`, which the selected and window branches
also use) and the compression MLP `cmp_k` (`compress="mlp"`); with
`AlignmentOptions(train_queries=True)` also the queries, `wq`, which all three branches share.
Every other parameter gets an exact zero.

Dense warm-up. A target computed from attention that only ever saw the selected blocks cannot
point at a block the selection missed. `dense_warmup_config(cfg, seq_len)` is `cfg` with `n_sel`
covering every block: the layer then selects every eligible block (the selected branch is full
causal attention) while the ranking learns from this loss; afterwards the layer runs with its own
`cfg` (the sparse stage) and the loss stays on (docs/API.md, "Selection alignment").

Cost. Dense: the target is computed here per chunk of `q_chunk` queries, looping over tiles of
`kv_blocks` selection blocks of keys: scores `[B, q_chunk, H, kv_blocks * l_sel]` at a time,
per-block log-sum-exps, and the result `[B, T, G, K]` (K = ceil(T / l_sel)): memory O(T * K),
never `[T, T]`; work, the score half of causal attention (T^2 H d_k / 2 multiply-adds; the key
tiles past a chunk's last query are skipped). Sparse: the target's per-slot masses come from the
dispatch entry `selected_block_mass` (T n_sel l_sel H d_k multiply-adds, the selected branch's
score half): on `backend="pallas"` one Pallas kernel that reads each selected block's keys once
per (token, group) and gathers nothing (`pallas_kernels.selected_block_mass`); on XLA, chunks
that gather the keys as above (packed sequences always take XLA). The importance p: in dense
mode the compressed scores of every block, `[B, q_chunk, H, C]` per chunk, recomputed in the
backward pass (O(T C)); in sparse mode only at the selected blocks: the compressed attention's
normaliser lse (one `compressed_attention` call on the backend, whose backward takes the lse's
cotangent) and the dispatch entry `selected_importance`: on `backend="pallas"` from T 32k
(`pallas_backend.IMPORTANCE_MIN_T`) two Pallas kernels that read the ~5 compressed keys
overlapping each selected block per (token, group), O(T n_sel) work forward and backward
(`pallas_kernels.selected_importance`; dk_cmp by float32 atomics); on XLA (shorter sequences,
packed ones) one `[B, q_chunk, H, C]` product per chunk from which the overlapping blocks' scores
are taken (`nsa_jax.xla.importance`). On an H200 (bench preset, one layer, forward+backward) the
KL part took 7.1 / 66.0 ms at 8k / 32k in XLA and 9.8 / 45.9 on the kernels (bench/RESULTS.md,
"Training step with the alignment loss").

Numerics. Scores and softmax in float32 (float64 for float64 inputs), and both distributions
in log space: a block's mass never underflows to a log of 0, and where the compressed attention
puts nearly all its mass on the forced blocks the candidates' relative importance (which still
decides the selection) survives. p~ is at least eps / (1 + |J| eps), so kl <= log(1 / eps + |J|)
(about 14 with the default eps), and the loss and its gradient are finite for any finite input:
a query with no admissible compressed block, a candidate that no admissible compressed block
overlaps (possible only with `n_local = 0`), scores of 1e8 (tested). A weight on the loss
scales its gradient and nothing else.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import chex
import jax
import jax.numpy as jnp
from jax import lax

from nsa_common import NSAConfig, num_cmp_blocks, num_sel_blocks, overlap_by_offset
from nsa_jax import checks, core, dispatch, layer
from nsa_jax.segments import Segments, from_cu_seqlens, single_sequence
from nsa_jax.xla.common import (block_logsumexp, compute_dtype, einsum, map_query_chunks,
                                masked_softmax, split_heads)
from nsa_jax.xla.compressed_attention import cmp_block_metadata, cmp_probabilities
from nsa_jax.xla.importance import log_importance_at
from nsa_jax.xla.importance import logsumexp_masked as _logsumexp
from nsa_jax.xla.selected_attention import gather_tokens
from nsa_jax.xla.selected_attention import selected_block_mass as xla_selected_block_mass

ALIGNMENT_MODES = ("dense", "sparse")


@dataclasses.dataclass(frozen=True)
class AlignmentOptions:
    """How `selection_alignment_loss` computes the objective (module docstring: the definition).

    mode: "dense" (default): candidates are every eligible non-forced block and the target is
        the full causal attention; "sparse": the layer's selected non-forced blocks and the
        selected branch's own attention (cheaper: no [T, T] work).
    train_queries: also let the gradient reach `wq` (default False: only the compressed keys,
        `wk["cmp"]` and `cmp_k`).
    eps: the floor of p, in (0, 0.1] (default 1e-6); bounds the loss by log(1 / eps + |J|).
    q_chunk: queries per chunk (default 256); kv_blocks: selection blocks of keys per step of
        the target's loop (default 16). They trade memory (scores `[B, q_chunk, H, kv_blocks *
        l_sel]` at a time) against the number of sequential steps; the loss does not depend
        on them.
    query_stride: s >= 1 (default 1): only every s-th query (positions s-1, 2s-1, ...) enters
        the loss, the mean over their (query, group) pairs: an estimate of the full mean at
        about 1/s of its cost. With s > 1 the loss's pieces run in XLA whatever the backend
        (the Pallas kernels take every query); the compression and the selection keep it.
    """

    mode: str = "dense"
    train_queries: bool = False
    eps: float = 1e-6
    q_chunk: int = 256
    kv_blocks: int = 16
    query_stride: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ALIGNMENT_MODES:
            raise ValueError(f"mode ({self.mode!r}) must be one of {ALIGNMENT_MODES}")
        if not isinstance(self.train_queries, bool):
            raise ValueError(f"train_queries ({self.train_queries!r}) must be a bool")
        if (isinstance(self.eps, bool) or not isinstance(self.eps, (int, float))
                or not 0 < self.eps <= 0.1):
            raise ValueError(f"eps ({self.eps!r}) must be a float in (0, 0.1]")
        checks.positive_int("q_chunk", self.q_chunk)
        checks.positive_int("kv_blocks", self.kv_blocks)
        checks.positive_int("query_stride", self.query_stride)


def query_rows(T: int, query_stride: int) -> Optional[jax.Array]:
    """The tokens whose queries a loss with `query_stride` s keeps: int32 `[s-1, 2s-1, ...]`
    below T (empty when T < s); None when s is 1 (every query)."""
    if query_stride == 1:
        return None
    return jnp.arange(query_stride - 1, T, query_stride, dtype=jnp.int32)


def dense_warmup_config(cfg: NSAConfig, seq_len: int) -> NSAConfig:
    """The dense warm-up stage's configuration: `cfg` with `n_sel` = the selection blocks of
    `seq_len` tokens (at least `cfg.n_sel`), so that the layer selects every eligible block and
    its selected branch is full causal attention. The parameters are those of `cfg`."""
    checks.config(cfg)
    checks.positive_int("seq_len", seq_len)
    return cfg.replace(n_sel=max(cfg.n_sel, num_sel_blocks(cfg, seq_len)))


def selection_alignment_loss(params: Mapping, x: jax.Array, cfg: NSAConfig, *,
                             alignment: Optional[AlignmentOptions] = None, cu_seqlens=None,
                             block_idx: Optional[jax.Array] = None,
                             backend: dispatch.Backend = "xla",
                             options: Optional[Mapping[str, Any]] = None,
                             precision: core.Precision = None, return_aux: bool = False):
    """The selection-alignment loss of one NSA layer (module docstring): a scalar (float32;
    float64 for float64 inputs), the mean KL over the (query, KV group) pairs that have a
    candidate block (0 if none has).

    params, x `[B, T, d_model]`, cfg, cu_seqlens, backend, options, precision: as for
    `nsa_attention` (the layer's own inputs and parameters; backend and options reach the
    compression and, in sparse mode, the selection).
    alignment: `AlignmentOptions` (default: dense, gradient to the compressed keys only).
    block_idx: sparse mode only, int `[B, T, G, n_sel]`: the selection the layer ran with
        (`aux["block_idx"]` of `nsa_attention(..., return_aux=True)`); None computes it.
    return_aux: also return dict(kl `[B, T, G]`, counted bool `[B, T, G]`).
    """
    alignment = AlignmentOptions() if alignment is None else alignment
    if not isinstance(alignment, AlignmentOptions):
        raise ValueError(f"alignment must be an AlignmentOptions, got {type(alignment).__name__}")
    x = core.as_jax_array(x)
    layer.check_layer_inputs(params, x, cfg)
    if cu_seqlens is not None:
        cu_seqlens = core.as_cu_seqlens(cu_seqlens)
        core.check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], "x")
    if block_idx is not None and alignment.mode != "sparse":
        raise ValueError("block_idx is used only with AlignmentOptions(mode='sparse')")
    block_idx = core.check_block_idx(block_idx, x.shape[:2], cfg.n_kv_heads, cfg)
    loss, kl, counted = _loss_jit(params, x, cu_seqlens, block_idx, cfg=cfg, alignment=alignment,
                                  backend=dispatch.static_backend(backend),
                                  options=dispatch.static_options(options),
                                  precision=core.check_precision(precision))
    chex.assert_shape([kl, counted], (*x.shape[:2], cfg.n_kv_heads))
    return (loss, dict(kl=kl, counted=counted)) if return_aux else loss


def _loss_unchecked(params, x, cu_seqlens, block_idx, *, cfg: NSAConfig,
                    alignment: AlignmentOptions, backend, options, precision):
    options = dict(options) if options else None
    with core.precision_scope(precision):
        B, T, _ = x.shape
        if cu_seqlens is None:
            segments, positions = None, jnp.arange(T, dtype=jnp.int32)
        else:
            segments = from_cu_seqlens(cu_seqlens, T, cfg)
            positions = segments.pos
        proj = layer.project(params, lax.stop_gradient(x), cfg, positions)
        q_fixed = lax.stop_gradient(proj["q"])
        q_ranked = proj["q"] if alignment.train_queries else q_fixed
        k_cmp = dispatch.call("compress_kv", backend, proj["k_cmp"],
                              params["cmp_k"] if cfg.compress == "mlp" else None, cfg,
                              segments=segments, options=options)
        if alignment.mode == "sparse" and block_idx is None:
            block_idx = dispatch.call("select_blocks", backend, q_fixed,
                                      lax.stop_gradient(k_cmp), cfg, scale=cfg.scale,
                                      segments=segments, options=options)
        rows = query_rows(T, alignment.query_stride)
        if rows is not None and rows.size == 0:   # no query kept: nothing to rank
            dtype = compute_dtype(x.dtype)
            return (jnp.zeros((), dtype), jnp.zeros((B, T, cfg.n_kv_heads), dtype),
                    jnp.zeros((B, T, cfg.n_kv_heads), bool))
        log_target = lax.stop_gradient(target_log_probs(
            q_fixed, proj["k_sel"], cfg, segments=segments, block_idx=block_idx,
            alignment=alignment, backend=backend, options=options, rows=rows))
        kl, counted = kl_rows(q_ranked, k_cmp, log_target, cfg, segments=segments,
                              block_idx=block_idx, alignment=alignment, backend=backend,
                              options=options, rows=rows)
    n_counted = jnp.sum(counted)
    loss = jnp.sum(jnp.where(counted, kl, 0.0)) / jnp.maximum(n_counted, 1)
    if rows is not None:   # per-token outputs: the rows not sampled hold 0 / not counted
        kl = jnp.zeros((B, T) + kl.shape[2:], kl.dtype).at[:, rows].set(kl)
        counted = jnp.zeros((B, T) + counted.shape[2:], bool).at[:, rows].set(counted)
    return loss, kl, counted


_loss_jit = jax.jit(_loss_unchecked,
                    static_argnames=("cfg", "alignment", "backend", "options", "precision"))


# -- the pieces, on projected tensors -------------------------------------------------------------
def candidates(block: jax.Array, q_pos: jax.Array, cfg: NSAConfig) -> jax.Array:
    """Whether each `block` (local index, -1 = none) `[B, Q, G, K]` is a candidate of the query
    at local position q_pos `[B, Q]`: eligible and not forced, `n_init <= j <= t // l_sel -
    n_local`."""
    last = (q_pos // cfg.sel_block)[:, :, None, None]
    return (block >= 0) & (block >= cfg.n_init) & (block <= last - cfg.n_local)


def _layout(T: int, segments: Optional[Segments], B: int):
    """Per-token `[B, T]` int32: (local position, first token of the sequence, sequence id,
    first compressed slot of the sequence); one sequence per row without segments."""
    if segments is None:
        zeros = jnp.zeros((B, T), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return pos, zeros, zeros, zeros
    return tuple(jnp.broadcast_to(a, (B, T)) for a in
                 (segments.pos, segments.start, segments.seg, segments.cmp_offset))


def target_log_probs(q: jax.Array, k_sel: jax.Array, cfg: NSAConfig, *,
                     segments: Optional[Segments], block_idx: Optional[jax.Array],
                     alignment: AlignmentOptions, backend: dispatch.Backend = "xla",
                     options: Optional[Mapping[str, Any]] = None,
                     rows: Optional[jax.Array] = None) -> jax.Array:
    """The target's log-probabilities over the candidates (module docstring), no gradient.

    q `[B, T, H, d_k]`, k_sel `[B, T, G, d_k]` (RoPE'd, as the selected branch sees them);
    block_idx int32 `[B, T, G, n_sel]` in sparse mode. -> `[B, T, G, K]`, -inf off the
    candidates: over blocks `0..K-1` (K = ceil(T / l_sel)) in dense mode, over the slots of
    block_idx (K = n_sel) in sparse mode. Sparse mode takes the selected branch's per-slot mass
    from the `selected_block_mass` dispatch entry (a Pallas kernel on `backend="pallas"`, else
    XLA); dense mode is computed here, in XLA. rows int `[Q]`: the queries at those tokens
    only (the result `[B, Q, G, K]`; sparse mode in XLA).
    """
    B, T = q.shape[:2]
    pos = _layout(T, segments, B)[0]
    q, k_sel = lax.stop_gradient(q), lax.stop_gradient(k_sel)
    if rows is not None:
        pos, q = pos[:, rows], q[:, rows]
        block_idx = None if block_idx is None else block_idx[:, rows]
    if alignment.mode == "dense":
        log_mass, blocks = _dense_log_mass(q, k_sel, cfg, segments, alignment, rows)
    elif rows is not None:
        log_mass = xla_selected_block_mass(q, k_sel, block_idx, block_size=cfg.sel_block,
                                           scale=cfg.scale, q_chunk=alignment.q_chunk,
                                           kv_blocks=alignment.kv_blocks, segments=segments,
                                           q_rows=rows)
        blocks = block_idx
    else:
        log_mass = dispatch.call("selected_block_mass", backend, q, k_sel, block_idx,
                                 block_size=cfg.sel_block, scale=cfg.scale,
                                 q_chunk=alignment.q_chunk, kv_blocks=alignment.kv_blocks,
                                 segments=segments, options=options)
        blocks = block_idx
    is_candidate = candidates(blocks, pos, cfg)
    _, log_total = masked_softmax(log_mass, is_candidate)
    return jnp.where(is_candidate, log_mass - log_total[..., None], -jnp.inf)


def _dense_log_mass(q, k_sel, cfg: NSAConfig, segments: Optional[Segments],
                    alignment: AlignmentOptions, rows: Optional[jax.Array] = None):
    """(log mass `[B, Q, G, K]` of the full causal attention on every selection block, summed
    over the group's heads, in the compute dtype; the block indices `[B, Q, G, K]`) for the
    queries q `[B, Q, H, d_k]` at tokens `rows` (None: every token, Q = T)."""
    B, Q, H, _ = q.shape
    T = k_sel.shape[1]
    G, L, kv = k_sel.shape[2], cfg.sel_block, alignment.kv_blocks
    dtype = compute_dtype(q.dtype, k_sel.dtype)
    pos, start, _, _ = _layout(T, segments, B)
    if rows is not None:
        pos, start = pos[:, rows], start[:, rows]
    K = num_sel_blocks(cfg, T)
    n_tiles = -(-K // kv)
    blocks = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, Q, G, K))
    shared = segments is None   # every query's block j is the same keys
    if shared:
        k_sel = jnp.pad(k_sel, [(0, 0), (0, n_tiles * kv * L - T), (0, 0), (0, 0)])
    else:
        # Gathered in the compute dtype, as the selected branch's XLA path gathers them.
        k_sel = k_sel.astype(dtype)
    offsets = jnp.arange(L, dtype=jnp.int32)

    def tile_shared(i, q_g, pos_c, start_c):
        del start_c
        keys = lax.dynamic_slice_in_dim(k_sel, i * kv * L, kv * L, axis=1)      # [B, kv*L, G, D]
        scores = einsum("bqghd,bkgd->bqghk", q_g, keys, dtype) * cfg.scale
        local = i * kv * L + jnp.arange(kv * L, dtype=jnp.int32)
        return block_logsumexp(scores, (local <= pos_c[..., None])[:, :, None, None, :], kv)

    def tile_gathered(i, q_g, pos_c, start_c):
        Q = q_g.shape[1]
        local = (i * kv + jnp.arange(kv, dtype=jnp.int32))[:, None] * L + offsets  # [kv, L]
        local = jnp.broadcast_to(local, (B, Q, G, kv, L))
        valid = local <= pos_c[:, :, None, None, None]
        token = jnp.clip(start_c[:, :, None, None, None] + local, 0, T - 1)
        keys = gather_tokens(k_sel, token.reshape(B, Q, G, kv * L))
        scores = einsum("bqghd,bqgkd->bqghk", q_g, keys, dtype) * cfg.scale
        return block_logsumexp(scores, valid.reshape(B, Q, G, 1, kv * L), kv)

    tile = tile_shared if shared else tile_gathered

    def body(chunk_start, q_c, pos_c, start_c):
        del chunk_start
        q_g = split_heads(q_c, G)
        Q, h = q_g.shape[1], q_g.shape[3]
        # The key tiles past the chunk's last query hold no causal key.
        count = jnp.minimum(n_tiles, jnp.max(pos_c) // (kv * L) + 1)
        lse = jnp.full((n_tiles, B, Q, G, h, kv), -jnp.inf, dtype)
        lse = lax.fori_loop(0, count, lambda i, acc: acc.at[i].set(
            tile(i, q_g, pos_c, start_c)), lse)
        lse = jnp.moveaxis(lse, 0, -2).reshape(B, Q, G, h, n_tiles * kv)[..., :K]
        # Each head's probabilities over every attended token, summed over the group's heads.
        norm = jax.nn.logsumexp(lse, axis=-1, keepdims=True)
        norm = jnp.where(jnp.isfinite(norm), norm, 0.0)
        return jax.nn.logsumexp(lse - norm, axis=3)                             # [B, Q, G, K]

    return map_query_chunks(body, alignment.q_chunk, q, pos, start), blocks


def log_importance(q: jax.Array, k_cmp: jax.Array, q_pos: jax.Array, q_seg: jax.Array,
                   cmp_offset: jax.Array, segments: Segments, n_blocks: int, cfg: NSAConfig, *,
                   packed: bool) -> jax.Array:
    """The log of the spec's group importance s (step 6) of a chunk of queries, in log space
    throughout (the candidates' relative scores survive where the compressed attention puts
    nearly all its mass on the forced blocks, and their gradient stays finite).

    q `[B, Q, H, d_k]`, k_cmp `[B, C, G, d_k]` (per-sequence slots when `packed`); q_pos, q_seg,
    cmp_offset `[B, Q]`; segments: the layout (`single_sequence` when not packed). ->
    `[B, Q, G, n_blocks]` over local selection blocks (-inf where no admissible compressed
    block overlaps the block).
    """
    dtype = compute_dtype(q.dtype, k_cmp.dtype)
    C = k_cmp.shape[1]
    cmp_last, cmp_seg = cmp_block_metadata(segments, cfg)
    scores = einsum("bqghd,bcgd->bqghc", split_heads(q, k_cmp.shape[2]), k_cmp,
                    dtype) * cfg.scale
    admissible = ((cmp_seg == q_seg[..., None]) & (cmp_last <= q_pos[..., None]))
    admissible = admissible[:, :, None, None, :]
    _, lse = masked_softmax(scores, admissible)
    log_p_cmp = jnp.where(admissible, scores - lse[..., None], -jnp.inf)
    log_group = _logsumexp(log_p_cmp, axis=3)                                   # [B, Q, G, C]
    if packed and C > 0:
        # Slots -> the query's own local block order (local block i is slot offset + i).
        slot = cmp_offset[..., None] + jnp.arange(C, dtype=jnp.int32)
        log_group = jnp.take_along_axis(log_group, jnp.clip(slot, 0, C - 1)[:, :, None, :], -1)
        log_group = jnp.where((slot < C)[:, :, None, :], log_group, -jnp.inf)
    # p_sel[j] = sum_m w_m p_cmp[j*r + m] (`overlap_by_offset`), as a log-sum-exp.
    r = cfg.sel_block // cfg.cmp_stride
    weights = overlap_by_offset(cfg)
    left, right = -weights[0][0], weights[-1][0]
    pad = [(0, 0)] * 3 + [(left, max(0, n_blocks * r + right - C))]
    padded = jnp.pad(log_group, pad, constant_values=-jnp.inf)
    terms = [padded[..., left + m:left + m + n_blocks * r:r] + math.log(w) for m, w in weights]
    return _logsumexp(jnp.stack(terms, axis=-1), axis=-1)


def compressed_lse(q: jax.Array, k_cmp: jax.Array, cfg: NSAConfig, *,
                   segments: Optional[Segments], backend: dispatch.Backend = "xla",
                   options: Optional[Mapping[str, Any]] = None) -> jax.Array:
    """The log normaliser of p_cmp per query and head, `[B, T, H]` float32+ (-inf where no
    compressed block is admissible), differentiable in q and k_cmp: the compressed attention's
    lse from the `compressed_attention` dispatch entry (the Pallas kernel's backward takes an lse
    cotangent as it takes dO), on a 16-wide zero value whose output is discarded. The fused
    cuDNN / FlashAttention-3 paths are turned off for this call: their lse carries no
    gradient."""
    B, C, G, _ = k_cmp.shape
    v = jnp.zeros((B, C, G, 16), k_cmp.dtype)
    _, lse = dispatch.call("compressed_attention", backend, q, k_cmp, v, cfg, scale=cfg.scale,
                           return_lse=True, segments=segments,
                           options=_without_fused_compressed(options))
    return lse


def _without_fused_compressed(options: Optional[Mapping[str, Any]]) -> dict:
    """`options` with `compressed_cudnn=False` for the XLA and Pallas backends."""
    from nsa_jax import pallas_backend
    from nsa_jax.xla import options as xla_options

    out = dict(options or {})
    for name, default in (("xla", xla_options.DEFAULT_OPTIONS),
                          ("pallas", pallas_backend.DEFAULT_OPTIONS)):
        out[name] = dataclasses.replace(out.get(name) or default, compressed_cudnn=False)
    return out


def kl_rows(q: jax.Array, k_cmp: jax.Array, log_target: jax.Array, cfg: NSAConfig, *,
            segments: Optional[Segments], block_idx: Optional[jax.Array],
            alignment: AlignmentOptions, backend: dispatch.Backend = "xla",
            options: Optional[Mapping[str, Any]] = None, rows: Optional[jax.Array] = None):
    """KL(target || p~) per query and group. q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]`
    (compressed keys; slots per sequence when packed), log_target from `target_log_probs`.
    -> (kl `[B, T, G]` in the compute dtype, counted bool `[B, T, G]`: J non-empty).

    Dense mode ranks every block: the compressed scores of all C blocks per query, chunk by
    chunk (O(T C) work and its backward, in XLA). Sparse mode needs the importance of the
    selected blocks only: the compressed attention's normaliser (`compressed_lse`, one call on
    `backend`) and the `selected_importance` dispatch entry (on `backend="pallas"` the kernels
    of `pallas_kernels.selected_importance`, O(T n_sel) work; on XLA, and for packed sequences,
    `nsa_jax.xla.importance`: one `[q_chunk, H, C]` product per chunk, then O(T n_sel)).
    rows int `[Q]`: the queries at those tokens only (log_target `[B, Q, G, K]`, the results
    `[B, Q, G]`; sparse mode's lse and importance in XLA).
    """
    B, T = q.shape[:2]
    S = num_sel_blocks(cfg, T)
    pos, _, seg, cmp_offset = _layout(T, segments, B)
    packed = segments is not None
    layout = segments
    if not packed:
        layout = single_sequence(T, num_cmp_blocks(cfg, T), cfg)
    if rows is not None:
        q, pos, seg, cmp_offset = (a[:, rows] for a in (q, pos, seg, cmp_offset))
        block_idx = None if block_idx is None else block_idx[:, rows]
    sparse = alignment.mode == "sparse"
    log_eps = math.log(alignment.eps)
    no_blocks = k_cmp.shape[1] == 0   # T < l: no compressed block, no importance
    extra = []
    if sparse and not no_blocks and rows is not None:
        extra.append(_importance_at_rows(q, k_cmp, block_idx, pos, seg, cmp_offset, layout, cfg,
                                         alignment.q_chunk))
    elif sparse and not no_blocks:
        lse = compressed_lse(q, k_cmp, cfg, segments=segments, backend=backend, options=options)
        extra.append(dispatch.call("selected_importance", backend, q, k_cmp, lse, block_idx, cfg,
                                   scale=cfg.scale, q_chunk=alignment.q_chunk,
                                   segments=segments, options=options))

    def body(chunk_start, q_c, log_t, pos_c, seg_c, offset_c, *sparse_c):
        del chunk_start
        if sparse and no_blocks:
            log_s = jnp.full(log_t.shape, -jnp.inf, log_t.dtype)
        elif sparse:
            log_s = sparse_c[0].astype(log_t.dtype)
        else:
            log_s = log_importance(q_c, k_cmp, pos_c, seg_c, offset_c, layout, S, cfg,
                                   packed=packed)
        is_candidate = log_t > -jnp.inf
        n = jnp.sum(is_candidate, axis=-1)
        log_s = jnp.where(is_candidate, log_s, -jnp.inf)
        log_total = _logsumexp(log_s, axis=-1)[..., None]
        # No candidate with any importance: p = 0, and p~ is uniform.
        log_p = jnp.where(log_total > -jnp.inf, log_s - jnp.maximum(log_total, -1e30), -jnp.inf)
        log_p = jnp.logaddexp(log_p, log_eps) - jnp.log1p(n * alignment.eps)[..., None]
        log_t = jnp.where(is_candidate, log_t, 0.0)
        terms = jnp.exp(log_t) * (log_t - log_p)
        return jnp.sum(jnp.where(is_candidate, terms, 0.0), axis=-1), n > 0

    return map_query_chunks(body, alignment.q_chunk, q, log_target, pos, seg, cmp_offset, *extra)


def _importance_at_rows(q, k_cmp, blocks, pos, seg, cmp_offset, layout: Segments, cfg: NSAConfig,
                        q_chunk: int) -> jax.Array:
    """The sparse mode's log importance `[B, Q, G, K]` of the queries q `[B, Q, H, d_k]` at
    local positions pos (sequences seg, first compressed slots cmp_offset; `[B, Q]` each), in
    XLA: per chunk, the compressed attention's lse (differentiable) and `log_importance_at`."""
    cmp_last, cmp_seg = cmp_block_metadata(layout, cfg)
    H = q.shape[2]

    def body(chunk_start, q_c, blocks_c, pos_c, seg_c, offset_c):
        del chunk_start
        _, lse = cmp_probabilities(q_c, k_cmp, pos_c, seg_c, cmp_last, cmp_seg, cfg.scale)
        lse = lse.reshape(lse.shape[:2] + (H,))
        return log_importance_at(q_c, k_cmp, lse, blocks_c, pos_c, seg_c, offset_c, layout, cfg,
                                 cfg.scale)

    return map_query_chunks(body, q_chunk, q, blocks, pos, seg, cmp_offset)
