"""Relaxed-System-Lab/Flash-Sparse-Attention (FSA; packages `fsa`, `nsa_ref`), from a checkout.

Its configuration (scripts/run_unit_test.sh, test/test_FSA_module.py): 4 KV heads with GQA
group 1 (H 4, G 4), d 128, compression kernel 32 / stride 16, selection blocks of 64, top 16 with
the first block and 2 local ones forced, window 512 (flash-attn's `window_size=(512, -1)`, keys
t - 512 .. t: ours runs with w = 513), one k / v for the three branches. FSA's own contribution
is the selected-attention kernel for small GQA groups (`fsa.ops.FSA_topk_sparse_attention`, a
KV-block-major loop); its module falls back to the reference NSA kernel
(`nsa_ref.ops.topk_sparse_attention`) at groups above 8, and so does this adapter. Its selection
scores use the first query head of each group, which is the group's sum only at group 1 (so
other head counts change the selection, not only the speed).

The core it runs, composed from FSA's public ops as `fsa.module.fsa.FlashSparseAttention.forward`
composes them, less the projections and RoPE (the core's inputs are projected and RoPE'd):
`nsa_ref.ops.avgpool_compress` (mean compression of k and v; its module's linear compression has
no counterpart in our configurations), `compressed_attention` (the compressed branch and the
top-k, scores rounded to bfloat16 before the top-k as its long-sequence path does), the
selected kernel, the window, and the gates (per head, sigmoid of logits [T, H, 3]). Its module
imports flash-attn for the window: this adapter uses the stand-in of bench/peers/window.py, timed
alone as well. A forced selection replaces the top-k (`compressed_attention(topk=0)` returns the
compressed branch alone).

Decode: `fsa_preview` (a beta of one sequence): `_compressed_attention_decode` (compressed
branch and top-k of the query at S - 1), `_topk_sparse_attention_decode` (the reference NSA
kernel) and the window (SDPA over the last 513 keys, as the stand-in), with the compressed K/V
precomputed; its module's per-step concatenation of the cache is left out.

Triton 3.6: one line of FSA's `reduce_kernel` (`fsa/ops/FSA_topk_sparse_attention.py` at
`1da34f3`) wraps a pointer in a 1-tuple, `lse_ptrs = (lse_ptr + pid_q_j * stride_lse_n,)`,
which Triton 3.6 types as a tuple (`'tuple_type' object has no attribute 'is_ptr'`). The other
kernels of `FSA_topk_sparse_attention`'s forward and backward compile as they are. Without the
parentheses and the comma the line is the pointer it meant; a checkout that still has them is
skipped with that reason (`triton_incompatibility`), not compiled and failed at its first call.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

from bench.peers import (DecodeCase, RecordsSelection, cu_seqlens, flash_window_config,
                         from_heads_first, heads_first, import_from, packed, window,
                         window_alone)

NAME = "fsa"
REPO = "Relaxed-System-Lab/Flash-Sparse-Attention"
HEADS = (4, 4)
D_MODEL = 4096
HEAD_DIM = 128
KERNEL, STRIDE, BLOCK, TOP_N, N_INIT, N_LOCAL, WINDOW = 32, 16, 64, 16, 1, 2, 512
FSA_MAX_GROUP = 8  # FSA's module runs its kernel up to this GQA group, the reference above


def config(heads: Optional[tuple[int, int]] = None):
    """Our NSAConfig in FSA's configuration (its window of 512 is 513 keys: w = 513)."""
    return flash_window_config(heads or HEADS, d_model=D_MODEL, head_dim=HEAD_DIM,
                               kernel=KERNEL, stride=STRIDE, block=BLOCK, top_n=TOP_N,
                               n_init=N_INIT, n_local=N_LOCAL, window_left=WINDOW)


def notes(cfg) -> str:
    kernel = ("FSA_topk_sparse_attention" if cfg.heads_per_group <= FSA_MAX_GROUP
              else "nsa_ref topk_sparse_attention (group > 8, as its module)")
    return (f"avgpool_compress + compressed_attention + {kernel}; window: flash-attn stand-in "
            f"(bench/peers/window.py), timed alone as window_standin; decode: fsa_preview ops, "
            f"B 1")


# The line of FSA's selected-attention kernels that Triton 3.6 does not compile (docstring).
KERNEL_FILE = "fsa/ops/FSA_topk_sparse_attention.py"
TUPLE_POINTER = "lse_ptrs = (lse_ptr + pid_q_j * stride_lse_n,)"
POINTER = "lse_ptrs = lse_ptr + pid_q_j * stride_lse_n"     # the line as it is meant


def triton_incompatibility(path: Optional[str], triton_version: str) -> Optional[str]:
    """Why the checkout at `path` will not compile under Triton `triton_version`, or None (no
    checkout, another file, or a Triton before 3.6, which this was not measured on)."""
    major_minor = tuple(int(part) for part in triton_version.split(".")[:2] if part.isdigit())
    source = os.path.join(path or "", KERNEL_FILE)
    if path is None or major_minor < (3, 6) or not os.path.isfile(source):
        return None
    with open(source, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip() == TUPLE_POINTER:
                return (f"{KERNEL_FILE}:{number} wraps a pointer in a 1-tuple, which Triton "
                        f"{triton_version} does not compile; write it as `{POINTER}` in "
                        f"the checkout")
    return None


def load(path: Optional[str], cfg) -> "Peer":
    try:
        import triton
    except ImportError:
        triton = None
    why = triton and triton_incompatibility(path, triton.__version__)
    if why:
        from bench.common import Skip
        raise Skip(why)
    return Peer(path, cfg)


class Peer(RecordsSelection):
    def __init__(self, path: Optional[str], cfg):
        self.cfg = cfg
        import_from(path, "nsa_ref.ops", "fsa.ops")
        from fsa.ops import FSA_topk_sparse_attention
        from nsa_ref.ops import avgpool_compress, compressed_attention, topk_sparse_attention

        self.compress = avgpool_compress
        self.compressed_attention = compressed_attention
        self.fsa_selected = FSA_topk_sparse_attention
        self.ref_selected = topk_sparse_attention
        self.path = path
        self.impl = "fsa.ops.FSA_topk_sparse_attention with nsa_ref compression / top-k"

    def window(self, q, k, v):
        """The window stand-in alone on BTHD tensors ([B, S, H, d_v])."""
        return window_alone(q, k, v, WINDOW)

    def prefill(self, q, k, v, gate_logits, block_idx=None):
        import torch

        B, S, H, D = q.shape
        G = k.shape[2]
        cu = cu_seqlens(B, S, q.device)
        qp, kp, vp = packed(q), packed(k), packed(v)
        k_cmp, cu_cmp = self.compress(kp, None, cu, KERNEL, STRIDE)
        v_cmp, _ = self.compress(vp, None, cu, KERNEL, STRIDE)
        max_cmp = (S - KERNEL) // STRIDE + 1
        scale = D ** -0.5
        if block_idx is None:
            o_cmp, topk = self.compressed_attention(
                qp, k_cmp, v_cmp, KERNEL, STRIDE, BLOCK, TOP_N, cu, cu_cmp, S, max_cmp, scale,
                N_INIT, N_LOCAL, parallel_topk_compute=False)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "topk <= 0, returned topk_idx will be None"
                o_cmp, _ = self.compressed_attention(
                    qp, k_cmp, v_cmp, KERNEL, STRIDE, BLOCK, 0, cu, cu_cmp, S, max_cmp, scale,
                    N_INIT, N_LOCAL, parallel_topk_compute=False)
            topk = heads_first(block_idx.to(q.device), fill=-1)
        selected = self.fsa_selected if H // G <= FSA_MAX_GROUP else self.ref_selected
        o_sel = selected(qp, kp, vp, topk, BLOCK, cu, scale)
        o_win = window.attention(qp, kp, vp, cu, S, WINDOW, scale)
        gates = torch.sigmoid(packed(gate_logits).float()).to(q.dtype)
        o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
        self.used = (topk, B, S)
        return o.reshape(B, S, H, -1)

    def decode_case(self, k, v, q_last, gate_last, block_idx=None) -> DecodeCase:
        """fsa_preview's decode ops for the query at S - 1 of one sequence."""
        import torch

        from bench.common import Skip

        B, S, G, D = k.shape
        if B != 1:
            raise Skip("FSA's decode (fsa_preview) takes one sequence (B 1)")
        import_from(self.path, "fsa_preview.ops")
        from fsa_preview.ops import _compressed_attention_decode, _topk_sparse_attention_decode

        device = k.device
        k1, v1 = k[0].contiguous(), v[0].contiguous()
        cu_k = torch.tensor([0, S], device=device, dtype=torch.int32)
        cu_q = torch.tensor([0, 1], device=device, dtype=torch.int32)
        k_cmp, cu_cmp = self.compress(k1, None, cu_k, KERNEL, STRIDE)
        v_cmp, _ = self.compress(v1, None, cu_k, KERNEL, STRIDE)
        n_cmp = k_cmp.shape[0]
        q1 = q_last.contiguous()
        scale = D ** -0.5
        gates = torch.sigmoid(gate_last.float()).to(q1.dtype)
        forced = (None if block_idx is None
                  else heads_first(block_idx[:, None].to(device), fill=-1))
        used = {}

        def step():
            if forced is None:
                o_cmp, topk = _compressed_attention_decode(
                    q1, k_cmp, v_cmp, KERNEL, STRIDE, BLOCK, TOP_N, cu_q, cu_cmp, 1, n_cmp,
                    scale, N_INIT, N_LOCAL, query_start_index=S - 1)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    o_cmp, _ = _compressed_attention_decode(
                        q1, k_cmp, v_cmp, KERNEL, STRIDE, BLOCK, 0, cu_q, cu_cmp, 1, n_cmp,
                        scale, N_INIT, N_LOCAL, query_start_index=S - 1)
                topk = forced
            used["idx"] = topk
            o_sel = _topk_sparse_attention_decode(q1, k1, v1, topk.contiguous(), BLOCK, cu_q,
                                                  cu_k, 1, S, scale)
            o_win = window.decode(q1, k, v, WINDOW, scale)
            return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win

        def selected():
            idx = used["idx"]
            return from_heads_first(idx, 1, 1, TOP_N, BLOCK, first=S - 1)[:, 0]

        return DecodeCase(step=step, block_idx=selected, graphable=False,
                          note="fsa_preview ops, compressed K/V precomputed, window via SDPA")
