"""FlashAttention-2 paths for the sliding-window (spec step 8) and compressed (spec step 5) branches.

Kernels, in order of preference:
1. the `flash_attn` package (`flash_attn_func` / `flash_attn_varlen_func`), when importable;
2. torch's own FlashAttention-2: `torch.nn.attention.varlen.varlen_attn` (packed sequences, and
   the sliding window when its signature has `window_size`), SDPA restricted to the flash backend
   (dense causal attention);
3. the reference (`nsa_torch_ref.reference`, backend "sdpa"), per packed sequence. A kernel path
   that cannot take a call raises `NotImplementedError` saying why (CPU tensors, float32/float64,
   head dims over 256, a window this torch cannot express) and the reference runs instead, so
   the entry points, backend "fa2" of `dispatch`, serve every input, packed ones included. The
   fallback is logged (NSA_DEBUG_LOG); it is never silently wrong, only slower.

Sliding window: query t sees keys t-w+1..t, which is FlashAttention's `causal=True,
window_size=(w - 1, 0)`.

Compressed branch: query t sees compressed block i iff `i*d + l - 1 <= t`. With T queries and
C blocks this is not FlashAttention's causal mask for any offset: a bottom-right aligned causal
mask lets query t see `t - (T - C) + 1` keys, one more per query, while here the count grows by
one every `d` queries. It *is* a square causal mask after a fold: write `t = l - 1 + m*d + r`
with `0 <= r < d`; query t sees blocks `0..m`. Folding `r` into the head axis turns the queries
into a `[C, H*d]` grid where query m sees keys `0..m`: plain causal attention with
`T_q = T_k = C`, `H*d` query heads and G KV heads (GQA ratio `h*d`; head `head*d + r` maps to KV
head `head // h`). Queries `t < l - 1` see no block and get 0. Packed sequences fold each
sequence on its own (`cu_seqlens` of the fold = cumulative C_n).

Head dims: FlashAttention-2 needs one head dim for q, k and v, a multiple of 8. Zero-padding q
and k leaves the scores unchanged and zero-padding v adds zero output columns, which are cut off;
the softmax scale is passed explicitly so padding does not change it.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from nsa_common import NSAConfig, num_cmp_blocks
from nsa_torch_ref import reference
from nsa_torch_ref.fast import runtime

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------
# What is installed
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _flash_attn():
    """The `flash_attn` package, or None. Optional: never needed to import this project."""
    try:
        import flash_attn
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return None
    if not (hasattr(flash_attn, "flash_attn_func")
            and hasattr(flash_attn, "flash_attn_varlen_func")):
        return None
    return flash_attn


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """(varlen_attn, its keyword names) from torch, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def versions() -> dict:
    """Versions and capabilities of the FA-2 kernels, for the routing summary."""
    fa = _flash_attn()
    tv = _torch_varlen()
    return {
        "flash_attn": getattr(fa, "__version__", "unknown") if fa is not None else None,
        "torch_varlen_attn": tv is not None,
        "torch_varlen_window": tv is not None and "window_size" in tv[1],
    }


def _kernel_ineligible(q: torch.Tensor, head_dim: int) -> Optional[str]:
    """Why no FlashAttention kernel can take `q` (None when one can)."""
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}: FlashAttention-2 needs CUDA"
    if q.dtype not in FLASH_DTYPES:
        return f"dtype {q.dtype}: FlashAttention-2 takes float16/bfloat16"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM}"
    return None


def kernel_choice(q: torch.Tensor, head_dim: int) -> tuple[str, str]:
    """("flash_attn" | "torch" | "reference", reason) for a call with these tensors."""
    why_not = _kernel_ineligible(q, head_dim)
    if why_not is not None:
        return "reference", why_not
    if _flash_attn() is not None:
        return "flash_attn", "flash_attn package"
    return "torch", "torch FlashAttention-2 (varlen_attn / SDPA flash backend)"


def _kernel(q: torch.Tensor, head_dim: int) -> str:
    """"flash_attn" or "torch"; NotImplementedError saying why when neither can take q."""
    kernel, reason = kernel_choice(q, head_dim)
    if kernel == "reference":
        raise NotImplementedError(reason)
    return kernel


# ---------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------
def _segments(cu_seqlens: Optional[torch.Tensor], B: int, T: int) -> list[tuple[int, int]]:
    """[(start, length)] of the packed sequences (one (0, T) without cu_seqlens)."""
    if cu_seqlens is None:
        return [(0, T)]
    bounds = reference.check_cu_seqlens(cu_seqlens, B, T)
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _pad_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def _common_head_dim(d_k: int, d_v: int) -> int:
    return -(-max(d_k, d_v) // 8) * 8


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Kernel calls: causal attention (optionally windowed), q/k/v share one padded head dim
# ---------------------------------------------------------------------------------------------
def _window_size(window: Optional[int]) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)


def _flash_attn_dense(q, k, v, scale, window):
    out = _flash_attn().flash_attn_func(q, k, v, softmax_scale=scale, causal=True,
                                        window_size=_window_size(window))
    return out[0] if isinstance(out, tuple) else out


def _flash_attn_varlen(q, k, v, cu, max_len, scale, window):
    """q [1, S, Hq, D] packed; cu int32 [N + 1]."""
    out = _flash_attn().flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, max_len, max_len, softmax_scale=scale, causal=True,
        window_size=_window_size(window))
    return (out[0] if isinstance(out, tuple) else out)[None]


def _torch_varlen_call(q, k, v, cu, max_len, scale, window):
    """torch's varlen_attn on packed [1, S, H, D] tensors; NotImplementedError if this torch
    cannot do it."""
    found = _torch_varlen()
    if found is None:
        raise NotImplementedError("this torch has no torch.nn.attention.varlen.varlen_attn")
    varlen_attn, params = found
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (window - 1, 0) if window is not None else (-1, 0)
    elif window is None and "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise NotImplementedError(f"this torch's varlen_attn has no window_size (window {window})")
    if q.shape[2] != k.shape[2]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            reps = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(reps, dim=2), v.repeat_interleave(reps, dim=2)
    out = varlen_attn(q[0], k[0], v[0], cu, cu, max_len, max_len, **kwargs)
    return (out[0] if isinstance(out, tuple) else out)[None]


def _torch_sdpa_flash(q, k, v, scale):
    """Dense causal attention through SDPA's flash backend; NotImplementedError if it refuses
    the call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    except RuntimeError as error:  # "No available kernel": shape/arch the flash backend rejects
        raise NotImplementedError(f"SDPA flash backend refused the call: {error}") from None
    return out.transpose(1, 2)


def _attend(kernel: str, q, k, v, segments: list[tuple[int, int]], scale: float,
            window: Optional[int], variant: str) -> torch.Tensor:
    """Causal (optionally windowed) attention of each segment over itself.

    q [B, S, Hq, D], k, v [B, S, Hk, D]; segments [(start, length)] of dim 1 (B = 1 when there is
    more than one). variant: "dense" (one dense call per segment), "varlen" (one packed call).
    Returns [B, S, Hq, D]; NotImplementedError when this kernel cannot take the call.
    """
    B = q.shape[0]
    if variant == "varlen":
        if B > 1:  # pack the batch rows as sequences of their own
            lengths = [length for _ in range(B) for _, length in segments]
            q, k, v = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, v))
        else:
            lengths = [length for _, length in segments]
        lengths_nz = [n for n in lengths if n > 0]  # empty sequences add nothing
        cu = _cu(lengths_nz, q.device)
        max_len = max(lengths_nz)
        if kernel == "flash_attn":
            out = _flash_attn_varlen(q, k, v, cu, max_len, scale, window)
        else:
            out = _torch_varlen_call(q, k, v, cu, max_len, scale, window)
        return out.reshape(B, -1, *out.shape[2:])

    parts = []
    for start, length in segments:
        if length == 0:
            continue
        qs, ks, vs = (x[:, start:start + length] for x in (q, k, v))
        if kernel == "flash_attn":
            out = _flash_attn_dense(qs, ks, vs, scale, window)
        elif window is None or window >= length:  # the window covers the segment: causal
            out = _torch_sdpa_flash(qs, ks, vs, scale)
        else:  # SDPA has no window: torch's varlen kernel, the batch rows as sequences
            packed = (x.reshape(1, B * length, *x.shape[2:]) for x in (qs, ks, vs))
            out = _torch_varlen_call(*packed, _cu([length] * B, q.device), length, scale, window)
            out = out.reshape(B, length, *out.shape[2:])
        parts.append(out)
    return torch.cat(parts, dim=1)


def _or_reference(what: str, kernels, fallback, config: runtime.RuntimeConfig) -> torch.Tensor:
    """kernels(), or fallback() (the reference) when they raise NotImplementedError (logged)."""
    try:
        return kernels()
    except NotImplementedError as why:
        runtime.debug_log("fa2", f"{what} -> reference: {why}", config)
        return fallback()


def _variant(n_segments: int, config: runtime.RuntimeConfig) -> str:
    """dense or varlen: packed input goes varlen unless forced dense; dense input goes dense
    unless forced varlen."""
    if config.fa2_force_dense:
        return "dense"
    if config.fa2_force_varlen:
        return "varlen"
    return "varlen" if n_segments > 1 else "dense"


# ---------------------------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------------------------
def _prefix_bad(kv_bad: torch.Tensor) -> torch.Tensor:
    """kv_bad bool [B, S, G] -> int [B, S + 1, G]: bad rows among the first s."""
    return torch.nn.functional.pad(torch.cumsum(kv_bad.to(torch.int32), dim=1), (0, 0, 1, 0))


def _guarded(run, q, k, v, rows_seeing):
    """Run `run(q, k, v)` on inputs whose non-finite entries are zeroed, and set to NaN the
    output rows that attend a non-finite key / value row or hold a non-finite query.

    FA-2 (and its reference fallback) multiply the masked keys of a tile by a zero weight:
    `0 * NaN = NaN` would carry one bad token to the queries that cannot see it, across
    causality and packed sequences. rows_seeing(prefix [B, S + 1, G]) -> bool [B, T, G]: the
    queries whose visible keys hold a bad row. The poisoned rows pass no gradient.
    """
    (q, q_bad), (k, k_bad), (v, v_bad) = (reference._split_finite(x) for x in (q, k, v))
    out = run(q, k, v)
    sees = rows_seeing(_prefix_bad(k_bad | v_bad))
    return reference._poison(out, q_bad | sees.repeat_interleave(q.shape[2] // k.shape[2], 2))


def _token_starts(segments: list[tuple[int, int]], device) -> torch.Tensor:
    """int64 [T]: first token of each token's sequence."""
    return torch.cat([torch.full((n,), s, dtype=torch.int64, device=device)
                      for s, n in segments] or [torch.zeros(0, dtype=torch.int64, device=device)])


def _window_reference(q, k, v, window, scale, segments):
    parts = [reference.sliding_window_attention(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n],
                                                window, scale)
             for s, n in segments if n > 0]
    return torch.cat(parts, dim=1) if parts else q.new_zeros(*q.shape[:3], v.shape[3])


def sliding_window_attention_fa2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                 scale: Optional[float] = None, *,
                                 cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sliding-window attention (query t sees keys max(0, t - w + 1) .. t) on FA-2 kernels.

    q: [B, T, H, d_k]; k: [B, T, G, d_k]; v: [B, T, G, d_v]; cu_seqlens: optional int [N + 1]
    (B = 1) packing sequences, each attending only within itself. Returns [B, T, H, d_v] in q's
    dtype; the kernels see k and v cast to q's dtype. Falls back to the reference where no
    kernel applies (module docstring).
    """
    reference._check_qkv(q, k, v)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window ({window!r}) must be a positive int")
    B, T, H, d_k = q.shape
    scale = reference._resolve_scale(scale, d_k)
    segments = _segments(cu_seqlens, B, T)
    t = torch.arange(T, device=q.device)
    lo = torch.maximum(_token_starts(segments, q.device), t - window + 1)

    def rows_seeing(prefix):  # keys [max(start, t - w + 1), t]
        return (prefix[:, t + 1] - prefix[:, lo]) > 0

    def run(q, k, v):
        config = runtime.load(q.device)
        return _or_reference(
            "sliding window", lambda: _window_kernels(q, k, v, window, scale, segments, config),
            lambda: _window_reference(q, k, v, window, scale, segments), config)

    return _guarded(run, q, k, v, rows_seeing)


def _window_kernels(q, k, v, window: int, scale: float, segments, config):
    """The window on an FA-2 kernel; NotImplementedError saying why when none takes the call."""
    B, T, H, d_k = q.shape
    d_v = v.shape[3]
    head_dim = _common_head_dim(d_k, d_v)
    kernel = _kernel(q, head_dim)
    if T == 0:
        raise NotImplementedError("no token (T = 0)")
    # One dtype for the kernel: under autocast k/v may come out float32 beside a bf16 q.
    qp, kp, vp = (_pad_dim(x.to(q.dtype), head_dim) for x in (q, k, v))
    out = _attend(kernel, qp, kp, vp, segments, scale, window, _variant(len(segments), config))
    return out[..., :d_v].to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Compressed branch
# ---------------------------------------------------------------------------------------------
def fold_index(cfg: NSAConfig, segments: list[tuple[int, int]], device):
    """Token index of every folded query row, the rows' validity, and the C_n per segment.

    Row `(c, r)` of segment n (c < C_n, r < d) is token `start_n + l - 1 + c*d + r`; it is
    valid when that token exists. Returns (index int64 [sum(C_n) * d], valid bool [same],
    [C_n]).
    """
    l, d = cfg.cmp_block, cfg.cmp_stride
    counts = [num_cmp_blocks(cfg, length) for _, length in segments]
    index, valid = [], []
    for (start, length), count in zip(segments, counts):
        local = l - 1 + torch.arange(count * d, device=device)
        index.append(start + local)
        valid.append(local < length)
    if not index:
        empty = torch.zeros(0, device=device, dtype=torch.int64)
        return empty, empty.bool(), counts
    return torch.cat(index), torch.cat(valid), counts


def _compressed_reference(q, k_cmp, v_cmp, cfg, scale, segments, counts):
    parts, offset = [], 0
    for (start, length), count in zip(segments, counts):
        if length == 0:
            continue
        parts.append(reference.compressed_attention(
            q[:, start:start + length], k_cmp[:, offset:offset + count],
            v_cmp[:, offset:offset + count], cfg, scale=scale))
        offset += count
    return torch.cat(parts, dim=1) if parts else q.new_zeros(*q.shape[:3], v_cmp.shape[3])


def compressed_attention_fa2(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                             cfg: NSAConfig, *, scale: Optional[float] = None,
                             return_lse: bool = False,
                             cu_seqlens: Optional[torch.Tensor] = None):
    """Compressed attention (query t sees block i iff i*d + l - 1 <= t) on FA-2 kernels through
    the fold of the module docstring.

    q: [B, T, H, d_k]; k_cmp: [B, C, G, d_k]; v_cmp: [B, C, G, d_v] with C =
    num_cmp_blocks(cfg, T). With cu_seqlens (int [N + 1], B = 1) k_cmp holds the blocks of each
    sequence one after the other: [1, sum_n num_cmp_blocks(cfg, T_n), G, d]. Returns
    o_cmp [B, T, H, d_v] in q's dtype (the kernels see k_cmp, v_cmp cast to it), 0 on rows with
    no admissible block. `return_lse=True`
    runs the reference (the kernels' lse layouts differ across flash_attn and torch versions;
    the layer does not ask for it).
    """
    if not isinstance(cfg, NSAConfig):
        raise ValueError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    reference._check_qkv(q, k_cmp, v_cmp, k_name="k_cmp", v_name="v_cmp", same_len=False)
    B, T, H, d_k = q.shape
    scale = reference._resolve_scale(scale, d_k)
    segments = _segments(cu_seqlens, B, T)
    index, valid, counts = fold_index(cfg, segments, q.device)
    if k_cmp.shape[1] != sum(counts):
        raise ValueError(f"k_cmp holds {k_cmp.shape[1]} blocks, expected {sum(counts)} "
                         f"(num_cmp_blocks per sequence {counts})")
    if return_lse:
        if cu_seqlens is not None:
            raise ValueError("return_lse is only supported without cu_seqlens")
        return reference.compressed_attention(q, k_cmp, v_cmp, cfg, scale=scale, return_lse=True)
    # Query t (local position p of sequence n) sees its sequence's blocks
    # [offset_n, offset_n + n_visible(p)), n_visible(p) = #{i : i*d + l - 1 <= p}.
    l, d = cfg.cmp_block, cfg.cmp_stride
    offsets = torch.tensor([0] + counts, device=q.device).cumsum(0)[:-1]
    first = _token_starts(segments, q.device)
    local = torch.arange(T, device=q.device) - first
    seq = torch.cat([torch.full((n,), i, device=q.device, dtype=torch.int64)
                     for i, (_, n) in enumerate(segments)])
    lo = offsets[seq]
    hi = lo + torch.where(local >= l - 1, torch.div(local - l + 1, d, rounding_mode="floor") + 1,
                          0)

    def rows_seeing(prefix):
        return (prefix[:, hi] - prefix[:, lo]) > 0

    def run(q, k_cmp, v_cmp):
        config = runtime.load(q.device)
        return _or_reference(
            "compressed",
            lambda: _compressed_kernels(q, k_cmp, v_cmp, cfg, scale, segments, index, valid,
                                        counts, config),
            lambda: _compressed_reference(q, k_cmp, v_cmp, cfg, scale, segments, counts), config)

    return _guarded(run, q, k_cmp, v_cmp, rows_seeing)


def _compressed_kernels(q, k_cmp, v_cmp, cfg: NSAConfig, scale: float, segments, index, valid,
                        counts, config):
    """The folded compressed branch on an FA-2 kernel; NotImplementedError saying why when none
    takes the call."""
    B, T, H, d_k = q.shape
    d_v = v_cmp.shape[3]
    head_dim = _common_head_dim(d_k, d_v)
    kernel = _kernel(q, head_dim)
    n_rows = sum(counts)
    if n_rows == 0:
        raise NotImplementedError("no compressed block yet (every row is 0)")
    d = cfg.cmp_stride
    # [B, sumC*d, H, dk] -> [B, sumC, H*d, dk]: head*d + r is the folded head.
    q_fold = q[:, index.clamp(max=T - 1)].reshape(B, n_rows, d, H, d_k)
    q_fold = q_fold.permute(0, 1, 3, 2, 4).reshape(B, n_rows, H * d, d_k)
    # One dtype for the kernel: under autocast the compressor's bias add makes k_cmp and
    # v_cmp float32 beside a bf16 q.
    qp, kp, vp = (_pad_dim(x.to(q.dtype), head_dim) for x in (q_fold, k_cmp, v_cmp))
    fold_segments, offset = [], 0
    for count in counts:
        fold_segments.append((offset, count))
        offset += count
    o_fold = _attend(kernel, qp, kp, vp, fold_segments, scale, None,
                     _variant(len(segments), config))
    o_rows = o_fold[..., :d_v].reshape(B, n_rows, H, d, d_v).permute(0, 1, 3, 2, 4)
    o_rows = o_rows.reshape(B, n_rows * d, H, d_v)[:, valid]
    return q.new_zeros(B, T, H, d_v).index_copy(1, index[valid], o_rows.to(q.dtype))
