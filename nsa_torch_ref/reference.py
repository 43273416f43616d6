"""The reference ("packed SDPA / gather") path of NSA's kernel-level functions (docs/NSA_SPEC.md).

Every function takes BTHD tensors (`[B, T, heads, dim]`), computes scores and softmax in float32
(float64 when the inputs are float64, so tests and `gradcheck` can run exactly) and returns the
dtype of `q`. Queries are processed in chunks sized so that the largest intermediate stays under
`ELEMENT_BUDGET` elements, and under autograd each chunk is checkpointed: no `[T, T]` float mask
is ever built, and 16k tokens (paper sizes, forward and backward) fit on one GPU.

Each branch has two levels: a `*_rows` helper for queries at arbitrary positions (used as-is by
`decode.py` for one query), and the public function that loops over query chunks.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nsa_common import (NSAConfig, cmp_admissible, num_cmp_blocks, num_sel_blocks,
                         overlap_weights)

# Largest per-chunk intermediate (scores or gathered keys), in elements. 2**26 float32 is 256 MiB.
ELEMENT_BUDGET = 1 << 26


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
# A module-wide switch, not a thread-local one: autograd may run the backward (and the
# checkpointed recomputation inside it) on a thread of its own.
_PLAIN = {"on": False}


@contextlib.contextmanager
def plain_arithmetic():
    """Within: bfloat16 / float16 inputs keep their dtype through every intermediate (scores,
    probabilities, the compression MLP's hidden layer), as plain PyTorch attention in that
    dtype does, instead of the float32 the reference otherwise computes in. The parity report's
    "plain same-dtype implementation" is the reference run this way (forward and backward)."""
    previous = _PLAIN["on"]
    _PLAIN["on"] = True
    try:
        yield
    finally:
        _PLAIN["on"] = previous


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact tests); every other float dtype accumulates in float32
    (keeps its own dtype inside `plain_arithmetic`)."""
    if dtype == torch.float64:
        return torch.float64
    if _PLAIN["on"] and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float32


def _resolve_scale(scale: Optional[float], d_k: int) -> float:
    return 1.0 / math.sqrt(d_k) if scale is None else float(scale)


def _query_chunks(n_queries: int, elements_per_query: int,
                  max_chunk: Optional[int] = None) -> Iterator[tuple[int, int]]:
    """(start, stop) ranges covering `n_queries`, each keeping the chunk under ELEMENT_BUDGET
    (and under `max_chunk` queries when given)."""
    chunk = max(1, min(n_queries, ELEMENT_BUDGET // max(1, elements_per_query)))
    if max_chunk is not None:
        chunk = max(1, min(chunk, max_chunk))
    for start in range(0, n_queries, chunk):
        yield start, min(n_queries, start + chunk)


def _chunk(fn, *args):
    """Run a per-chunk helper. Under autograd it runs checkpointed (recomputed in backward), so
    training keeps one chunk's scores and gathered keys alive at a time instead of all of them:
    without it a 16k-token backward holds every chunk's intermediates (110 GiB at the paper's
    sizes in bfloat16, against 3.5 GiB with it, measured on an H200)."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim restricted to `mask` (bool, broadcastable to `scores`).

    Returns (probs [..., S], lse [...]). A row with no allowed entry gets probs = 0 and
    lse = -inf, and its gradients are exactly zero: the row max is replaced by 0 before the
    shift (so no `-inf - -inf`), the denominator by 1, and masked entries are `exp(-inf) = 0`.
    The max is detached because softmax does not depend on the shift.
    """
    if scores.shape[-1] == 0:
        return scores, scores.new_full(scores.shape[:-1], -math.inf)
    scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    probs = weights / torch.where(nonempty, denom, torch.ones_like(denom))
    lse = torch.where(nonempty, row_max + torch.log(torch.where(nonempty, denom, 1.0)),
                      -math.inf)
    return probs, lse.squeeze(-1)


def _split_finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x with non-finite entries zeroed, bool [...]: the row holds one).

    Attention multiplies every key and value by a weight, the masked ones too (weight 0), and
    `0 * NaN = NaN`: one non-finite token would reach every query of the product, across
    causality and the tokens a gathered block holds past the query, forward (`p @ v`) and
    backward (`ds^T @ q`, `ds @ k`). The branches therefore compute on zeroed operands and
    `_poison` the rows that did see a non-finite value afterwards.
    """
    finite = torch.isfinite(x)
    return torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)), \
        ~finite.all(dim=-1)


def _poison(o: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """o [..., d] with the rows where bad [...] is True set to NaN. `masked_fill` passes no
    gradient to the filled rows, so a loss over the clean rows gets exactly the clean gradients
    (a loss over a NaN row is NaN anyway)."""
    return o.masked_fill(bad[..., None], math.nan)


def _check_rank4(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a [B, T, heads, dim] tensor, got {shape}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, k_name: str = "k",
               v_name: str = "v", same_len: bool = True) -> None:
    """Shapes of a GQA attention call: q [B,T,H,dk], k [B,S,G,dk], v [B,S,G,dv], G | H."""
    _check_rank4("q", q)
    _check_rank4(k_name, k)
    _check_rank4(v_name, v)
    B, T, H, d_k = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, {k_name} {k.shape[0]}, {v_name} {v.shape[0]}")
    if k.shape[3] != d_k:
        raise ValueError(f"{k_name} head dim ({k.shape[3]}) must equal q's ({d_k})")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must agree on "
                         "length and heads")
    if H % k.shape[2]:
        raise ValueError(f"q heads ({H}) must be a multiple of {k_name} heads ({k.shape[2]})")
    if same_len and k.shape[1] != T:
        raise ValueError(f"{k_name} length ({k.shape[1]}) must equal q length ({T})")


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int, *,
                     require_int32: bool = False) -> list[int]:
    """The bounds `[0, ..., T]` of packed sequences, validated: sequence n holds tokens
    `bounds[n]:bounds[n + 1]` of the one batch row. cu_seqlens: integer (int32 with
    `require_int32`, as the layer and flash-attn take it) [N + 1], N >= 1; batch, length: B, T."""
    is_tensor = isinstance(cu_seqlens, torch.Tensor)
    integer = is_tensor and not (cu_seqlens.is_floating_point() or cu_seqlens.is_complex()
                                 or cu_seqlens.dtype == torch.bool)
    if not integer or (require_int32 and cu_seqlens.dtype != torch.int32):
        got = cu_seqlens.dtype if is_tensor else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be an {'int32' if require_int32 else 'integer'} "
                         f"tensor, got {got}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B = {batch}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length}, got "
                         f"{bounds[0]} .. {bounds[-1]}")
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return bounds


def _group(q: torch.Tensor, n_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, d] -> [B, T, G, h, d]: query head i belongs to group i // h."""
    B, T, H, d = q.shape
    return q.reshape(B, T, n_groups, H // n_groups, d).to(dtype)


# ---------------------------------------------------------------------------------------------
# RoPE and compression
# ---------------------------------------------------------------------------------------------
def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (GPT-NeoX) RoPE over the whole head dim (spec step 3).

    x: [B, T, heads, D] (D even); positions: [T] integer positions. Pair (i, i + D/2) turns by
    `pos * theta^(-2i/D)`. Computed in the accumulation dtype, returned in x's dtype.
    """
    acc = _acc_dtype(x.dtype)
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device)
                         / x.shape[-1])
    angle = positions.to(torch.float64)[:, None] * inv_freq  # [T, D/2]
    cos = angle.cos().to(acc)[None, :, None, :]
    sin = angle.sin().to(acc)[None, :, None, :]
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def compress_kv(k: torch.Tensor, cmp_params: Optional[Mapping[str, torch.Tensor]],
                cfg: NSAConfig) -> torch.Tensor:
    """Compress keys (or values) into blocks (spec step 4).

    k: [B, T, G, D]; cmp_params: the `cmp_k` / `cmp_v` mapping (`pos` [G, l, D], `w1`
    [G, l*D, D], `b1` [G, D], `w2` [G, D, D], `b2` [G, D]), or None for the mean of each block
    (`compress="mean"`).
    Returns [B, C, G, D], C = num_cmp_blocks(cfg, T); block i covers tokens [i*d, i*d + l).
    With C = 0 the result is empty but still connected to the graph, so every parameter gets a
    (zero) gradient instead of None. A block holding a non-finite token is NaN; the MLP runs on
    zeroed tokens so that the zero gradient of a block nobody sees does not meet
    `gelu'(NaN)` (`0 * NaN`) and reach the block's other, finite tokens.
    """
    _check_rank4("k", k)
    B, T, G, D = k.shape
    l, d = cfg.cmp_block, cfg.cmp_stride
    if num_cmp_blocks(cfg, T) == 0:
        blocks = k[:, :0, :, None, :].expand(B, 0, G, l, D)
    else:
        blocks = k.unfold(1, l, d).permute(0, 1, 2, 4, 3)  # [B, C, G, l, D]
    # In the accumulation dtype, rounded once at the end (as the JAX path): a bfloat16 hidden
    # layer would round every summary twice more.
    acc = _acc_dtype(k.dtype)
    if cmp_params is None:
        return blocks.to(acc).mean(dim=3).to(k.dtype)
    blocks, token_bad = _split_finite(blocks.to(acc))
    block_bad = token_bad.any(dim=-1)  # [B, C, G]
    if cmp_params["pos"].shape != (G, l, D):
        raise ValueError(f"cmp_params['pos'] shape {tuple(cmp_params['pos'].shape)} must be "
                         f"{(G, l, D)} for k of shape {tuple(k.shape)}")
    w = {name: value.to(acc) for name, value in cmp_params.items()}
    flat = (blocks + w["pos"]).flatten(3)  # token-major: [s, c] -> s*D + c
    hidden = F.gelu(torch.einsum("bcgi,gio->bcgo", flat, w["w1"]) + w["b1"])
    out = torch.einsum("bcgi,gio->bcgo", hidden, w["w2"]) + w["b2"]
    return _poison(out, block_bad).to(k.dtype)


# ---------------------------------------------------------------------------------------------
# Compressed attention and block selection
# ---------------------------------------------------------------------------------------------
def _compressed_rows(q, k_cmp, v_cmp, q_pos, cfg: NSAConfig, scale: float):
    """Compressed attention for queries at positions q_pos [Tq].

    q [B, Tq, H, dk], k_cmp [B, C, G, dk], v_cmp [B, C, G, dv] (v_cmp may be None when only the
    probabilities are wanted). Returns (o [B, Tq, H, dv] or None, p_cmp [B, Tq, G, h, C],
    lse [B, Tq, H]), all in the accumulation dtype. o and lse are NaN on the rows that see a
    non-finite query, key or value; p_cmp is computed from their zeroed (finite) versions.
    """
    acc = _acc_dtype(q.dtype)
    B, Tq, H, _ = q.shape
    C, G = k_cmp.shape[1], k_cmp.shape[2]
    q_safe, q_bad = _split_finite(_group(q, G, acc))                      # q_bad [B, Tq, G, h]
    k_safe, kv_bad = _split_finite(k_cmp.to(acc))                         # kv_bad [B, C, G]
    if v_cmp is not None:
        v_safe, v_bad = _split_finite(v_cmp.to(acc))
        kv_bad = kv_bad | v_bad
    scores = torch.einsum("bqghd,bcgd->bqghc", q_safe, k_safe) * scale
    admissible = cmp_admissible(torch.arange(C, device=q.device)[None, :], q_pos[:, None],
                                cfg.cmp_block, cfg.cmp_stride)  # [Tq, C]
    p_cmp, lse = _masked_softmax(scores, admissible[None, :, None, None, :])
    sees_bad = torch.einsum("qc,bcg->bqg", admissible.to(acc), kv_bad.to(acc)) > 0
    bad = q_bad | sees_bad[..., None]                                     # [B, Tq, G, h]
    o = None
    if v_cmp is not None:
        # Explicit sizes, no -1: a reshape cannot infer it from 0 elements (B = 0).
        o = _poison(torch.einsum("bqghc,bcgd->bqghd", p_cmp, v_safe), bad)
        o = o.reshape(B, Tq, H, v_safe.shape[-1])
    return o, p_cmp, lse.masked_fill(bad, math.nan).reshape(B, Tq, H)


def compressed_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                         cfg: NSAConfig, *, scale: Optional[float] = None,
                         return_lse: bool = False):
    """Attention of every query over the compressed blocks it may see (spec step 5).

    q: [B, T, H, dk] at positions 0..T-1; k_cmp: [B, C, G, dk]; v_cmp: [B, C, G, dv].
    Query t sees block i iff i*d + l - 1 <= t. Returns o_cmp [B, T, H, dv] in q's dtype (zero for
    queries with no admissible block, C = 0 included) and, with `return_lse`, lse [B, T, H]
    float32 (-inf on those rows).
    """
    _check_qkv(q, k_cmp, v_cmp, k_name="k_cmp", v_name="v_cmp", same_len=False)
    scale = _resolve_scale(scale, q.shape[-1])
    B, T, H, _ = q.shape
    positions = torch.arange(T, device=q.device)
    outs, lses = [], []
    for start, stop in _query_chunks(T, B * H * max(1, k_cmp.shape[1])):
        o, _, lse = _chunk(_compressed_rows, q[:, start:stop], k_cmp, v_cmp,
                           positions[start:stop], cfg, scale)
        outs.append(o)
        lses.append(lse)
    o_cmp = torch.cat(outs, dim=1).to(q.dtype)
    if return_lse:
        return o_cmp, torch.cat(lses, dim=1).float()
    return o_cmp


def importance_scores(p_cmp: torch.Tensor, q_pos: torch.Tensor, cfg: NSAConfig,
                      n_sel_blocks: int, overlap: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The selection's block importance (spec step 6) of p_cmp [B, Tq, G, h, C] for queries at
    q_pos [Tq]: the GQA sum of p_cmp @ M, forced blocks at +inf, ineligible ones at -inf.
    -> [B, Tq, G, n_sel_blocks]."""
    C = p_cmp.shape[-1]
    if overlap is None:
        overlap = torch.from_numpy(overlap_weights(cfg, C, n_sel_blocks)).to(p_cmp)  # [C, S]
    # sum_heads(p_cmp @ M) = sum_heads(p_cmp) @ M: summing the group's heads first makes the
    # matmul h times smaller (at 64k tokens, h = 16: 1.1 instead of 17.6 TFLOP in float32).
    score = p_cmp.sum(dim=3) @ overlap  # [B, Tq, G, S]
    block = torch.arange(n_sel_blocks, device=p_cmp.device)[None, :]
    last = (q_pos // cfg.sel_block)[:, None]  # newest eligible block per query
    eligible = block <= last  # [Tq, S]
    forced = eligible & ((block < cfg.n_init) | (block > last - cfg.n_local))
    score = score.masked_fill(forced[None, :, None, :], math.inf)
    return score.masked_fill(~eligible[None, :, None, :], -math.inf)


def _select_rows(p_cmp: torch.Tensor, q_pos: torch.Tensor, cfg: NSAConfig,
                 n_sel_blocks: int, overlap: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-n_sel selection blocks from compressed probabilities (spec step 6).

    p_cmp: [B, Tq, G, h, C] for queries at positions q_pos [Tq]; n_sel_blocks: selection blocks
    of the sequence; overlap: `overlap_weights(cfg, C, n_sel_blocks)` on p_cmp's device and dtype
    (built here when absent; callers looping over query chunks build it once: rebuilding the
    [C, S] matrix per chunk cost 1.2 s of a 32k-token forward on an H200).
    Returns block_idx int32 [B, Tq, G, n_sel], ascending, -1 padded at the end.
    """
    score = importance_scores(p_cmp, q_pos, cfg, n_sel_blocks, overlap)

    # A stable descending sort keeps equal scores in index order: ties go to the lower block.
    ranked_score, ranked = torch.sort(score, dim=-1, descending=True, stable=True)
    take = min(cfg.n_sel, n_sel_blocks)
    chosen = ranked[..., :take]
    # Ineligible picks become a sentinel past every real index, so an ascending sort moves them
    # to the end, where they turn into -1.
    chosen = torch.where(ranked_score[..., :take] == -math.inf, n_sel_blocks, chosen)
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == n_sel_blocks, -1, chosen)
    if take < cfg.n_sel:
        chosen = F.pad(chosen, (0, cfg.n_sel - take), value=-1)
    return chosen.to(torch.int32)


@torch.no_grad()
def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, cfg: NSAConfig, *,
                  scale: Optional[float] = None) -> torch.Tensor:
    """Selection blocks per query and KV group (spec step 6). No gradient flows.

    q: [B, T, H, dk] at positions 0..T-1; k_cmp: [B, C, G, dk].
    Returns block_idx int32 [B, T, G, n_sel]: ascending, -1 padded at the end.
    """
    _check_qkv(q, k_cmp, k_cmp, k_name="k_cmp", v_name="k_cmp", same_len=False)
    scale = _resolve_scale(scale, q.shape[-1])
    B, T, H, _ = q.shape
    n_sel_blocks = num_sel_blocks(cfg, T)
    positions = torch.arange(T, device=q.device)
    overlap = torch.from_numpy(overlap_weights(cfg, k_cmp.shape[1], n_sel_blocks)).to(
        device=q.device, dtype=_acc_dtype(q.dtype))
    parts = []
    for start, stop in _query_chunks(T, B * H * (max(1, k_cmp.shape[1]) + n_sel_blocks)):
        _, p_cmp, _ = _compressed_rows(q[:, start:stop], k_cmp, None, positions[start:stop],
                                       cfg, scale)
        parts.append(_select_rows(p_cmp, positions[start:stop], cfg, n_sel_blocks, overlap))
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------------------------------------
# Selected attention
# ---------------------------------------------------------------------------------------------
def _selected_rows(q, k, v, block_idx, block_size: int, q_pos, scale: float) -> torch.Tensor:
    """Selected attention by gathering each query's chosen tokens.

    q [B, Tq, H, dk] at positions q_pos [Tq]; k [B, S, G, dk], v [B, S, G, dv] hold tokens
    0..S-1; block_idx [B, Tq, G, n]. Gathers [B, Tq, G, n*block_size] keys; a token counts if
    its block is not -1, it exists (< S) and it is <= the query's position.
    Returns o [B, Tq, H, dv] in the accumulation dtype.
    """
    acc = _acc_dtype(q.dtype)
    B, Tq, H, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    block_idx = block_idx.long()
    token = block_idx[..., None] * block_size + torch.arange(block_size, device=q.device)
    valid = ((block_idx[..., None] >= 0) & (token < S)
             & (token <= q_pos[None, :, None, None, None]))  # [B, Tq, G, n, block_size]
    token = token.clamp(0, max(S - 1, 0)).flatten(3)  # [B, Tq, G, n*block_size]
    valid = valid.flatten(3)
    batch = torch.arange(B, device=q.device)[:, None, None, None]
    group = torch.arange(G, device=q.device)[None, None, :, None]
    # k, v arrive in the accumulation dtype (see selected_attention): gathered there, their
    # gradients are scattered back in float32, not summed in bfloat16.
    k_sel, k_bad = _split_finite(k[batch, token, group])  # [B, Tq, G, n*block_size, dk]
    v_sel, v_bad = _split_finite(v[batch, token, group])
    q_safe, q_bad = _split_finite(_group(q, G, acc))
    scores = torch.einsum("bqghd,bqgsd->bqghs", q_safe, k_sel) * scale
    probs, _ = _masked_softmax(scores, valid[:, :, :, None, :])
    bad = q_bad | (valid & (k_bad | v_bad)).any(dim=-1)[..., None]
    o = _poison(torch.einsum("bqghs,bqgsd->bqghd", probs, v_sel), bad)
    return o.reshape(B, Tq, H, v_sel.shape[-1])


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       block_idx: torch.Tensor, block_size: int,
                       scale: Optional[float] = None) -> torch.Tensor:
    """Attention of query t (head in group g) over the tokens <= t of blocks block_idx[b, t, g]
    (spec step 7). -1 entries are ignored.

    q: [B, T, H, dk]; k: [B, T, G, dk]; v: [B, T, G, dv]; block_idx: integer [B, T, G, n].
    Returns [B, T, H, dv] in q's dtype.
    """
    _check_qkv(q, k, v)
    B, T, H, d_k = q.shape
    G = k.shape[2]
    if (not isinstance(block_idx, torch.Tensor) or block_idx.dim() != 4
            or tuple(block_idx.shape[:3]) != (B, T, G)):
        shape = tuple(block_idx.shape) if isinstance(block_idx, torch.Tensor) else block_idx
        raise ValueError(f"block_idx must be an integer [B, T, G, n] = [{B}, {T}, {G}, n] tensor, "
                         f"got {shape}")
    if block_idx.is_floating_point() or block_idx.is_complex():
        raise ValueError(f"block_idx must be an integer tensor, got {block_idx.dtype}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size ({block_size!r}) must be a positive int")
    scale = _resolve_scale(scale, d_k)
    positions = torch.arange(T, device=q.device)
    n_keys = block_idx.shape[3] * block_size  # gathered keys per query and group
    per_query = B * (G * n_keys * (d_k + v.shape[3]) + H * n_keys)
    acc = _acc_dtype(q.dtype)
    k_acc, v_acc = k.to(acc), v.to(acc)
    outs = [_chunk(_selected_rows, q[:, start:stop], k_acc, v_acc, block_idx[:, start:stop],
                   block_size, positions[start:stop], scale)
            for start, stop in _query_chunks(T, per_query)]
    return torch.cat(outs, dim=1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------------------------
def _window_rows(q, k, v, q_pos, k_pos, window: int, scale: float) -> torch.Tensor:
    """Sliding-window attention of queries at q_pos [Tq] over keys at k_pos [S].

    q [B, Tq, H, dk]; k [B, S, G, dk]; v [B, S, G, dv]. Key s is seen iff
    q_pos - window < k_pos[s] <= q_pos. Returns o [B, Tq, H, dv] in the accumulation dtype.
    """
    acc = _acc_dtype(q.dtype)
    B, Tq, H, _ = q.shape
    G = k.shape[2]
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    (q_safe, q_bad), (k_safe, k_bad) = _split_finite(_group(q, G, acc)), _split_finite(k.to(acc))
    v_safe, v_bad = _split_finite(v.to(acc))
    scores = torch.einsum("bqghd,bsgd->bqghs", q_safe, k_safe) * scale
    probs, _ = _masked_softmax(scores, visible[None, :, None, None, :])
    sees_bad = torch.einsum("qs,bsg->bqg", visible.to(acc), (k_bad | v_bad).to(acc)) > 0
    o = torch.einsum("bqghs,bsgd->bqghd", probs, v_safe)
    return _poison(o, q_bad | sees_bad[..., None]).reshape(B, Tq, H, v_safe.shape[-1])


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """Query t attends keys max(0, t - window + 1) .. t (spec step 8).

    q: [B, T, H, dk]; k: [B, T, G, dk]; v: [B, T, G, dv]. Returns [B, T, H, dv] in q's dtype.
    Each query chunk [t0, t1) only looks at the key slice [t0 - window + 1, t1).
    """
    _check_qkv(q, k, v)
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"window ({window!r}) must be a positive int")
    B, T, H, d_k = q.shape
    scale = _resolve_scale(scale, d_k)
    positions = torch.arange(T, device=q.device)
    # A chunk of c queries scores c * (c + window - 1) pairs per head: capping c keeps the
    # cost per query near `window` instead of growing with T.
    max_chunk = max(window, 256)
    outs = []
    for start, stop in _query_chunks(T, B * H * (max_chunk + window), max_chunk=max_chunk):
        lo = max(0, start - window + 1)
        outs.append(_chunk(_window_rows, q[:, start:stop], k[:, lo:stop], v[:, lo:stop],
                           positions[start:stop], positions[lo:stop], window, scale))
    return torch.cat(outs, dim=1).to(q.dtype)
