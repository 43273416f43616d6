"""Triton selected attention (spec step 7), forward and backward, as a `torch.autograd.Function`.

Query `t`, head in group `g`, attends the tokens of blocks `block_idx[b, t, g, :]` (ignoring -1)
that are `<= t`. Three kernels:

- `_sel_fwd_kernel`, one program per (t, b*G + g): the `h` heads of the group are one tile of
  `BLOCK_H >= 16` rows (so `tl.dot` has a legal M), the program walks the `n_sel` listed blocks
  with an online softmax in float32 and stores `o` and `lse`.
- `_sel_bwd_dq_kernel`, the same walk, recomputing `p = exp(s - lse)`, accumulating `dq`.
- `_sel_bwd_dkdv_kernel`, one program per (key tile of one selection block, b*G + g): it reads
  the queries that selected this block from an inverse index (CSR: `ptr` per block, query
  positions sorted ascending) and accumulates `dk`, `dv` in a fixed order. Every key belongs to
  exactly one block, so each `dk`/`dv` row is written by one program: no atomics, deterministic.

Packed sequences (`cu_seqlens`, B = 1): block indices are local to each sequence, so the kernels
add the sequence's first token to each block start; the inverse index numbers the blocks of all
sequences one after the other.

Offsets: batch and token indices are widened to int64 before they meet a stride, so
`B*T*H*d > 2**31` does not overflow. Float32 inputs use `input_precision="ieee"` (no TF32), so
float32 results match a float32 reference to ~1e-6.

On CPU the kernels run under the Triton interpreter: `TRITON_INTERPRET=1` must be set before this
module is imported (Triton reads it when `@triton.jit` decorates the kernels).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from nsa_torch_ref.dispatch import Unsupported
from nsa_torch_ref.reference import (_check_qkv, _poison, _resolve_scale, _split_finite,
                                     check_cu_seqlens)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class SelectionBlockSizes:
    """Tile sizes. `block_n`: keys per tile (a selection block is walked in tiles of this many
    keys); `rows_kv`: query rows (queries x padded heads of a group) per tile of the dk/dv
    kernel. Both are powers of two >= 16 (the minimum `tl.dot` dimension)."""

    block_n: int = 64
    rows_kv: int = 64
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def for_dims(cls, block_size: int, d_k: int, d_v: int) -> "SelectionBlockSizes":
        """Smaller tiles for wide heads (d 192/256) so the dk/dv accumulators stay in registers
        and shared memory fits on sm_89 (100 KiB)."""
        wide = max(d_k, d_v) > 128
        block_n = min(max(16, triton.next_power_of_2(block_size)), 32 if wide else 64)
        return cls(block_n=block_n, rows_kv=32 if wide else 64, num_warps=8 if wide else 4)


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------------------------
# Kernels. `stride_x` is tensor x's `.stride()` tuple, in x's axis order (B, T, H or G, D; lse
# B, T, H; block_idx B, T, G, slot). Triton specializes each element as it would a separate
# argument (a unit stride becomes a constant): the PTX for sm90 is byte-identical to the one
# with one argument per stride (Triton 3.6 and 3.9, compiled on a CPU host).
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`tl.dot` with float32 accumulation. UPCAST is set only under the Triton interpreter with
    bfloat16 inputs: its `tl.dot` multiplies the raw 16-bit patterns of bfloat16 as integers
    (Triton 3.9 `InterpreterBuilder.create_dot`), so the operands go through float32 there."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _sel_prologue(Q, SEQ_START, stride_q, G,
                  HPG: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
                  BLOCK_DV: tl.constexpr, VARLEN: tl.constexpr):
    """The start of `_sel_fwd_kernel` and `_sel_bwd_dq_kernel`, program (t, b*G + g): the heads
    of group g are the rows of the tile.

    Returns (t, g, t64, b64, head: int64 [BLOCK_H] head numbers, offs_n, offs_dk, offs_dv,
    mask_h, mask_dk, mask_dv, q: [BLOCK_H, BLOCK_DK] query tile (0 in padding), seq_start: first
    token of t's sequence, 0 when not VARLEN)."""
    t = tl.program_id(0)
    b = tl.program_id(1) // G
    g = tl.program_id(1) % G
    t64 = t.to(tl.int64)
    b64 = b.to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < HPG
    mask_dk = offs_dk < D_K
    mask_dv = offs_dv < D_V
    head = (g * HPG + offs_h).to(tl.int64)

    q = tl.load(Q + b64 * stride_q[0] + t64 * stride_q[1] + head[:, None] * stride_q[2]
                + offs_dk[None, :] * stride_q[3],
                mask=mask_h[:, None] & mask_dk[None, :], other=0.0)
    seq_start = 0
    if VARLEN:
        seq_start = tl.load(SEQ_START + t)
    return (t, g, t64, b64, head, offs_n, offs_dk, offs_dv, mask_h, mask_dk, mask_dv, q,
            seq_start)


@triton.jit
def _sel_bases(IDX, K, V, stride_i, stride_k, stride_v, t64, b64, g):
    """Returns the pointers to query t's block list and to group g's keys and values."""
    idx_base = IDX + b64 * stride_i[0] + t64 * stride_i[1] + g * stride_i[2]
    k_base = K + b64 * stride_k[0] + g * stride_k[2]
    v_base = V + b64 * stride_v[0] + g * stride_v[2]
    return idx_base, k_base, v_base


@triton.jit
def _sel_block_start(idx_base, s, stride_is, seq_start, BLOCK_SIZE: tl.constexpr):
    """Returns the first token of the `s`-th listed block `j` (local to the sequence; a padding
    j < 0 gives a start before seq_start)."""
    j = tl.load(idx_base + s * stride_is)
    blk_start = seq_start + j * BLOCK_SIZE
    return blk_start


@triton.jit
def _load_key_rows(base, kpos64, kmask, offs_d, mask_d, stride_t, stride_d):
    """Returns rows `kpos64` of the [T, d] key or value matrix at `base` (one batch, one group):
    [BLOCK_N, BLOCK_D], 0 where `kmask` or `mask_d` is off."""
    return tl.load(base + kpos64[:, None] * stride_t + offs_d[None, :] * stride_d,
                   mask=kmask[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _sel_key_tile(k_base, blk_start, c, seq_start, t, offs_n, offs_dk, mask_dk,
                  stride_kt, stride_kd, BLOCK_SIZE: tl.constexpr):
    """Keys `c + offs_n` of the listed block starting at `blk_start`, as query `t` sees them.

    Returns (kmask [BLOCK_N]: the keys in the block, in t's sequence and `<= t`; kpos64 int64
    [BLOCK_N]: their token positions; k [BLOCK_N, BLOCK_DK], 0 where masked)."""
    kpos = blk_start + c + offs_n
    # Padding (j < 0) puts every key before seq_start; with `kpos <= t` this also keeps
    # each load inside the tensor, whatever block_idx holds.
    kmask = (c + offs_n < BLOCK_SIZE) & (kpos >= seq_start) & (kpos <= t)
    kpos64 = kpos.to(tl.int64)
    k = _load_key_rows(k_base, kpos64, kmask, offs_dk, mask_dk, stride_kt, stride_kd)
    return kmask, kpos64, k


@triton.jit
def _sel_fwd_kernel(
    Q, K, V, IDX, SEQ_START, O, LSE,
    stride_q, stride_k, stride_v, stride_i, stride_o, stride_l,
    G, scale,
    HPG: tl.constexpr, N_SEL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    (t, g, t64, b64, head, offs_n, offs_dk, offs_dv, mask_h, mask_dk, mask_dv, q,
     seq_start) = _sel_prologue(Q, SEQ_START, stride_q, G,
                                HPG, D_K, D_V, BLOCK_H, BLOCK_N, BLOCK_DK, BLOCK_DV, VARLEN)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    idx_base, k_base, v_base = _sel_bases(IDX, K, V, stride_i, stride_k, stride_v, t64, b64, g)
    for s in range(N_SEL):
        blk_start = _sel_block_start(idx_base, s, stride_i[3], seq_start, BLOCK_SIZE)
        for c in range(0, BLOCK_SIZE, BLOCK_N):
            kmask, kpos64, k = _sel_key_tile(k_base, blk_start, c, seq_start, t, offs_n, offs_dk,
                                             mask_dk, stride_k[1], stride_k[3], BLOCK_SIZE)
            scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
            scores = tl.where(kmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 instead of -inf - -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_key_rows(v_base, kpos64, kmask, offs_dv, mask_dv, stride_v[1], stride_v[3])
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(O + b64 * stride_o[0] + t64 * stride_o[1] + head[:, None] * stride_o[2]
             + offs_dv[None, :] * stride_o[3], o.to(O.dtype.element_ty),
             mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(LSE + b64 * stride_l[0] + t64 * stride_l[1] + head * stride_l[2], lse, mask=mask_h)


@triton.jit
def _sel_bwd_dq_kernel(
    Q, K, V, IDX, SEQ_START, DO, LSE, DELTA, DQ,
    stride_q, stride_k, stride_v, stride_i, stride_do, stride_l, stride_dq,
    G, scale,
    HPG: tl.constexpr, N_SEL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    (t, g, t64, b64, head, offs_n, offs_dk, offs_dv, mask_h, mask_dk, mask_dv, q,
     seq_start) = _sel_prologue(Q, SEQ_START, stride_q, G,
                                HPG, D_K, D_V, BLOCK_H, BLOCK_N, BLOCK_DK, BLOCK_DV, VARLEN)
    do = tl.load(DO + b64 * stride_do[0] + t64 * stride_do[1] + head[:, None] * stride_do[2]
                 + offs_dv[None, :] * stride_do[3],
                 mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    row = b64 * stride_l[0] + t64 * stride_l[1] + head * stride_l[2]
    lse = tl.load(LSE + row, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # an empty row has p = 0 everywhere
    delta = tl.load(DELTA + row, mask=mask_h, other=0.0)

    dq = tl.zeros([BLOCK_H, BLOCK_DK], dtype=tl.float32)
    idx_base, k_base, v_base = _sel_bases(IDX, K, V, stride_i, stride_k, stride_v, t64, b64, g)
    for s in range(N_SEL):
        blk_start = _sel_block_start(idx_base, s, stride_i[3], seq_start, BLOCK_SIZE)
        for c in range(0, BLOCK_SIZE, BLOCK_N):
            kmask, kpos64, k = _sel_key_tile(k_base, blk_start, c, seq_start, t, offs_n, offs_dk,
                                             mask_dk, stride_k[1], stride_k[3], BLOCK_SIZE)
            v = _load_key_rows(v_base, kpos64, kmask, offs_dv, mask_dv, stride_v[1], stride_v[3])
            scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
            p = tl.where(kmask[None, :], tl.exp(scores - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)

    tl.store(DQ + b64 * stride_dq[0] + t64 * stride_dq[1] + head[:, None] * stride_dq[2]
             + offs_dk[None, :] * stride_dq[3], (dq * scale).to(DQ.dtype.element_ty),
             mask=mask_h[:, None] & mask_dk[None, :])


@triton.jit
def _sel_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    BLK_START, BLK_END, INV_PTR, INV_T,
    stride_q, stride_k, stride_v, stride_do, stride_l, stride_dk, stride_dv,
    G, N_BLOCKS, scale,
    HPG: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_CHUNKS: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr,
    H_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    blk = tl.program_id(0) // N_CHUNKS
    chunk = tl.program_id(0) % N_CHUNKS
    bg = tl.program_id(1)
    b = bg // G
    g = bg % G
    b64 = b.to(tl.int64)

    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dk = offs_dk < D_K
    mask_dv = offs_dv < D_V

    blk_start = tl.load(BLK_START + blk)
    blk_end = tl.load(BLK_END + blk)
    kpos = blk_start + chunk * BLOCK_N + offs_n
    kmask = (chunk * BLOCK_N + offs_n < BLOCK_SIZE) & (kpos < blk_end)
    kpos64 = kpos.to(tl.int64)
    k = tl.load(K + b64 * stride_k[0] + kpos64[:, None] * stride_k[1] + g * stride_k[2]
                + offs_dk[None, :] * stride_k[3], mask=kmask[:, None] & mask_dk[None, :], other=0.0)
    v = tl.load(V + b64 * stride_v[0] + kpos64[:, None] * stride_v[1] + g * stride_v[2]
                + offs_dv[None, :] * stride_v[3], mask=kmask[:, None] & mask_dv[None, :], other=0.0)

    # Row r of a query tile is (query r // H_PAD of the list, head r % H_PAD of the group).
    r_query = offs_r // H_PAD
    r_head = offs_r % H_PAD
    head = (g * HPG + r_head).to(tl.int64)
    list_id = bg.to(tl.int64) * N_BLOCKS + blk
    lo = tl.load(INV_PTR + list_id)
    hi = tl.load(INV_PTR + list_id + 1)

    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for i in range(lo, hi, ROWS // H_PAD):
        entry = i + r_query
        rmask = (entry < hi) & (r_head < HPG)
        tq = tl.load(INV_T + entry, mask=rmask, other=0)
        tq64 = tq.to(tl.int64)
        q = tl.load(Q + b64 * stride_q[0] + tq64[:, None] * stride_q[1] + head[:, None] * stride_q[2]
                    + offs_dk[None, :] * stride_q[3], mask=rmask[:, None] & mask_dk[None, :],
                    other=0.0)
        do = tl.load(DO + b64 * stride_do[0] + tq64[:, None] * stride_do[1]
                     + head[:, None] * stride_do[2] + offs_dv[None, :] * stride_do[3],
                     mask=rmask[:, None] & mask_dv[None, :], other=0.0)
        row = b64 * stride_l[0] + tq64 * stride_l[1] + head * stride_l[2]
        lse = tl.load(LSE + row, mask=rmask, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(DELTA + row, mask=rmask, other=0.0)

        scores_t = _dot(k, tl.trans(q), PRECISION, UPCAST) * scale  # [BLOCK_N, ROWS]
        valid = kmask[:, None] & rmask[None, :] & (kpos[:, None] <= tq[None, :])
        p_t = tl.where(valid, tl.exp(scores_t - lse[None, :]), 0.0)
        dv += _dot(p_t.to(do.dtype), do, PRECISION, UPCAST)
        dp_t = _dot(v, tl.trans(do), PRECISION, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, PRECISION, UPCAST)

    tl.store(DK + b64 * stride_dk[0] + kpos64[:, None] * stride_dk[1] + g * stride_dk[2]
             + offs_dk[None, :] * stride_dk[3], (dk * scale).to(DK.dtype.element_ty),
             mask=kmask[:, None] & mask_dk[None, :])
    tl.store(DV + b64 * stride_dv[0] + kpos64[:, None] * stride_dv[1] + g * stride_dv[2]
             + offs_dv[None, :] * stride_dv[3], dv.to(DV.dtype.element_ty),
             mask=kmask[:, None] & mask_dv[None, :])


# ---------------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------------
def _interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1)."""
    return type(_sel_fwd_kernel).__name__ == "InterpretedFunction"


def _validate(q, k, v, block_idx, block_size, cu_seqlens):
    """ValueError on a bad argument; `Unsupported` (also a ValueError) on an input the kernels
    cannot take, so that `dispatch` moves on to the next backend."""
    _check_qkv(q, k, v)
    if not isinstance(block_idx, torch.Tensor) or block_idx.dim() != 4:
        got = tuple(block_idx.shape) if isinstance(block_idx, torch.Tensor) else \
            type(block_idx).__name__
        raise ValueError(f"block_idx must be a rank-4 tensor, got {got}")
    B, T, H, d_k = q.shape
    G = k.shape[2]
    if tuple(block_idx.shape[:3]) != (B, T, G) or block_idx.shape[3] < 1:
        raise ValueError(f"block_idx must be [B, T, G, n_sel] = [{B}, {T}, {G}, n_sel >= 1], got "
                         f"{tuple(block_idx.shape)}")
    if block_idx.is_floating_point() or block_idx.is_complex() or block_idx.dtype == torch.bool:
        raise ValueError(f"block_idx must be an integer tensor, got {block_idx.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size ({block_size!r}) must be a positive int")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise Unsupported(f"q dtype ({q.dtype}) must be one of {_SUPPORTED_DTYPES}")
    for name, tensor in (("k", k), ("v", v)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {tensor.dtype}")
    devices = {q.device, k.device, v.device, block_idx.device}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, block_idx must be on one device, got {sorted(map(str, devices))}")
    if T >= 2 ** 31:
        raise Unsupported(f"sequence length T ({T}) must be < 2**31 (token positions are int32)")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
    if q.device.type != "cuda" and not _interpreted():
        raise Unsupported(
            f"selected_attention_triton got tensors on {q.device}: the Triton kernels need CUDA "
            "tensors, or TRITON_INTERPRET=1 set before nsa_torch_ref.fast.triton_selection is "
            "imported")


def _segments(T: int, block_size: int, cu_seqlens: Optional[torch.Tensor], device):
    """Per-token sequence start [T] (None when dense) and the selection-block table.

    Returns (seq_start int32 [T] or None, blk_start int32 [NB], blk_end int32 [NB],
    blk_offset int64 [N]: the number of the first block of each sequence)."""
    if cu_seqlens is None:
        starts = torch.arange(0, T, block_size, device=device, dtype=torch.int64)
        return None, starts.int(), (starts + block_size).clamp(max=T).int(), None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    n_blocks = (lengths + block_size - 1) // block_size
    blk_offset = torch.cumsum(n_blocks, 0) - n_blocks
    seq_of_block = torch.repeat_interleave(torch.arange(len(lengths), device=device), n_blocks)
    local = torch.arange(int(n_blocks.sum()), device=device) - blk_offset[seq_of_block]
    blk_start = cu[:-1][seq_of_block] + local * block_size
    blk_end = torch.minimum(blk_start + block_size, cu[1:][seq_of_block])
    seq_start = torch.repeat_interleave(cu[:-1], lengths)
    return seq_start.int(), blk_start.int(), blk_end.int(), blk_offset


def inverse_index(block_idx: torch.Tensor, block_size: int, n_blocks: int,
                  seq_start: Optional[torch.Tensor], blk_offset: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor]):
    """CSR lists of the queries that selected each block, per (b, g).

    block_idx: int [B, T, G, n_sel]. Returns (ptr int64 [B*G*n_blocks + 1], query int32 [E]):
    the queries of list `(b*G + g)*n_blocks + block` are `query[ptr[i]:ptr[i+1]]`, ascending.
    Entries that reach no key `<= t` (padding, or a block past the query) are dropped: they
    contribute nothing in the forward. Built with a stable sort and `searchsorted` (no atomics),
    so the lists, and the dk/dv sums over them, are deterministic.
    """
    B, T, G, n_sel = block_idx.shape
    device = block_idx.device
    idx = block_idx.long()
    t = torch.arange(T, device=device)[None, :, None, None]
    local_t = t if seq_start is None else t - seq_start.long()[None, :, None, None]
    valid = (idx >= 0) & (idx * block_size <= local_t)
    gid = idx
    if cu_seqlens is not None:
        seq_id = torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64)[1:-1],
                                    torch.arange(T, device=device), right=True)
        gid = idx + blk_offset[seq_id][None, :, None, None]
    b = torch.arange(B, device=device)[:, None, None, None]
    g = torch.arange(G, device=device)[None, None, :, None]
    key = ((b * G + g) * n_blocks + gid)[valid]
    query = t.expand(B, T, G, n_sel)[valid]
    key, order = torch.sort(key, stable=True)
    ptr = torch.searchsorted(key, torch.arange(B * G * n_blocks + 1, device=device))
    return ptr.to(torch.int64), query[order].to(torch.int32)


def _common(q, k, v, block_size):
    B, T, H, d_k = q.shape
    G, d_v = k.shape[2], v.shape[3]
    sizes = SelectionBlockSizes.for_dims(block_size, d_k, d_v)
    meta = dict(
        HPG=H // G, BLOCK_SIZE=block_size, D_K=d_k, D_V=d_v,
        BLOCK_DK=_pow2_at_least_16(d_k), BLOCK_DV=_pow2_at_least_16(d_v),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=_interpreted() and q.dtype == torch.bfloat16,
    )
    return sizes, meta


def _forward(q, k, v, block_idx, block_size, scale, seq_start):
    B, T, H, d_k = q.shape
    G, d_v = k.shape[2], v.shape[3]
    sizes, meta = _common(q, k, v, block_size)
    o = torch.empty((B, T, H, d_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, T, H), device=q.device, dtype=torch.float32)
    if T == 0:
        return o, lse
    dummy = block_idx if seq_start is None else seq_start
    _sel_fwd_kernel[(T, B * G)](
        q, k, v, block_idx, dummy, o, lse,
        q.stride(), k.stride(), v.stride(), block_idx.stride(), o.stride(), lse.stride(),
        G, scale,
        N_SEL=block_idx.shape[3], BLOCK_H=_pow2_at_least_16(H // G), BLOCK_N=sizes.block_n,
        VARLEN=seq_start is not None, num_warps=sizes.num_warps, num_stages=sizes.num_stages,
        **meta,
    )
    return o, lse


def _backward(q, k, v, block_idx, block_size, scale, o, lse, do, segments, cu_seqlens):
    B, T, H, d_k = q.shape
    G = k.shape[2]
    seq_start, blk_start, blk_end, blk_offset = segments
    sizes, meta = _common(q, k, v, block_size)
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1)  # [B, T, H]: rowsum(dO * O), the softmax term
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if T == 0:
        return dq, dk, dv
    dummy = block_idx if seq_start is None else seq_start
    _sel_bwd_dq_kernel[(T, B * G)](
        q, k, v, block_idx, dummy, do, lse, delta, dq,
        q.stride(), k.stride(), v.stride(), block_idx.stride(), do.stride(), lse.stride(),
        dq.stride(), G, scale,
        N_SEL=block_idx.shape[3], BLOCK_H=_pow2_at_least_16(H // G), BLOCK_N=sizes.block_n,
        VARLEN=seq_start is not None, num_warps=sizes.num_warps, num_stages=sizes.num_stages,
        **meta,
    )
    n_blocks = blk_start.numel()
    ptr, queries = inverse_index(block_idx, block_size, n_blocks, seq_start, blk_offset,
                                 cu_seqlens)
    h_pad = triton.next_power_of_2(H // G)
    rows = max(sizes.rows_kv, h_pad, 16)
    n_chunks = triton.cdiv(block_size, sizes.block_n)
    if queries.numel() == 0:
        queries = torch.zeros(1, device=q.device, dtype=torch.int32)
    _sel_bwd_dkdv_kernel[(n_blocks * n_chunks, B * G)](
        q, k, v, do, lse, delta, dk, dv, blk_start, blk_end, ptr, queries,
        q.stride(), k.stride(), v.stride(), do.stride(), lse.stride(),
        dk.stride(), dv.stride(), G, n_blocks, scale,
        N_CHUNKS=n_chunks, H_PAD=h_pad, ROWS=rows, BLOCK_N=sizes.block_n,
        num_warps=sizes.num_warps, num_stages=sizes.num_stages, **meta,
    )
    return dq, dk, dv


class SelectedAttentionTriton(torch.autograd.Function):
    """o = selected_attention(q, k, v, block_idx); no gradient for block_idx."""

    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, cu_seqlens):
        segments = _segments(q.shape[1], block_size, cu_seqlens, q.device)
        o, lse = _forward(q, k, v, block_idx, block_size, scale, segments[0])
        ctx.save_for_backward(q, k, v, block_idx, o, lse)
        ctx.block_size, ctx.scale, ctx.segments, ctx.cu_seqlens = block_size, scale, segments, cu_seqlens
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, block_idx, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, block_idx, ctx.block_size, ctx.scale, o, lse, do,
                               ctx.segments, ctx.cu_seqlens)
        return dq, dk, dv, None, None, None, None


def _rows_seeing_nonfinite(kv_bad: torch.Tensor, block_idx: torch.Tensor, block_size: int,
                           seq_start: Optional[torch.Tensor]) -> torch.Tensor:
    """bool [B, T, G]: query t of group g attends a token whose key or value is non-finite.

    kv_bad [B, T, G]; block_idx [B, T, G, n] (local to the query's sequence); seq_start [T] or
    None. Block j of query t covers tokens [start + j*l, min(start + j*l + l, t + 1)), counted
    with prefix sums: O(T * n) bookkeeping beside the kernel.
    """
    B, T, G = kv_bad.shape
    counts = torch.nn.functional.pad(torch.cumsum(kv_bad.to(torch.int32), dim=1), (0, 0, 1, 0))
    t = torch.arange(T, device=kv_bad.device)
    start = torch.zeros_like(t) if seq_start is None else seq_start.long()
    lo = start[None, :, None, None] + block_idx.long() * block_size                # [B, T, G, n]
    hi = torch.minimum(lo + block_size, t[None, :, None, None] + 1)
    lo, hi = lo.clamp(0, T), hi.clamp(0, T)
    hi = torch.maximum(hi, lo)

    def count_at(idx):  # counts[b, idx[b, t, g, i], g]
        flat = idx.permute(0, 2, 1, 3).reshape(B, G, -1)
        got = torch.gather(counts.permute(0, 2, 1), 2, flat)
        return got.reshape(B, G, T, -1).permute(0, 2, 1, 3)

    n_bad = torch.where(block_idx >= 0, count_at(hi) - count_at(lo), 0)
    return n_bad.sum(dim=-1) > 0


def selected_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              block_idx: torch.Tensor, block_size: int,
                              scale: Optional[float] = None, *,
                              cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Selected attention with the Triton kernels (differentiable in q, k, v).

    q: [B, T, H, d_k]; k: [B, T, G, d_k]; v: [B, T, G, d_v] (cast to q's dtype: float16,
    bfloat16 or float32); block_idx: integer [B, T, G, n_sel], ascending with -1 padding
    (int32 after conversion). Query t attends the
    tokens <= t of its listed blocks. `cu_seqlens` (int [N + 1], B = 1) packs sequences: block
    indices are then local to each sequence. Returns [B, T, H, d_v] in q's dtype.

    Non-finite inputs: the kernels load whole blocks, also the tokens past t, and multiply them
    by a zero weight (`0 * NaN = NaN`). They therefore get the inputs with non-finite entries
    zeroed, and the rows that attend such a token (or whose query holds one) become NaN
    afterwards, with no gradient: a loss over the other rows gets the clean gradients.
    """
    _validate(q, k, v, block_idx, block_size, cu_seqlens)
    scale = _resolve_scale(scale, q.shape[-1])
    # One dtype for the kernel (autocast can hand over k, v in another); autograd casts the
    # gradients back.
    q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    block_idx = block_idx.to(torch.int32).contiguous()
    (q, q_bad), (k, k_bad), (v, v_bad) = _split_finite(q), _split_finite(k), _split_finite(v)
    seq_start = None if cu_seqlens is None else _segments(q.shape[1], block_size, cu_seqlens,
                                                          q.device)[0]
    B, T, H, _ = q.shape
    G = k.shape[2]
    sees_bad = _rows_seeing_nonfinite(k_bad | v_bad, block_idx, block_size, seq_start)
    bad = q_bad | sees_bad.repeat_interleave(H // G, dim=2)                        # [B, T, H]
    o = SelectedAttentionTriton.apply(q, k, v, block_idx, block_size, scale, cu_seqlens)
    return _poison(o, bad)


def selected_attention_triton_with_lse(q, k, v, block_idx, block_size, scale=None, *,
                                       cu_seqlens=None):
    """Forward only: (o [B, T, H, d_v], lse [B, T, H] float32). For tests and decode."""
    _validate(q, k, v, block_idx, block_size, cu_seqlens)
    scale = _resolve_scale(scale, q.shape[-1])
    segments = _segments(q.shape[1], block_size, cu_seqlens, q.device)
    return _forward(q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(),
                    block_idx.to(torch.int32).contiguous(), block_size, scale, segments[0])
