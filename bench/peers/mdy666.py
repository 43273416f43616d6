"""mdy666/Scalable-Flash-Native-Sparse-Attention (package `flash_nsa`), from a checkout.

Its configuration (flash_nsa.NSAConfig defaults, its README's benchmark): H 64, G 4, d 128,
mean compression of k and v with kernel 32 / stride 16, selection blocks of 64, top 16 with the
first block and the 2 local ones forced, window 512, one k / v for the three branches, sigmoid
gates per head from logits [T, H, 3]. Its window is flash-attn's `window_size=(512, -1)`, keys
t - 512 .. t: 513 keys, so ours runs with w = 513. Selection scores: compressed probabilities
summed over the group with the block-overlap weights [1, 2, 2, 2, 1], as ours.

Prefill: `flash_nsa.NSACore` (its Megatron-level autograd function on packed sequences,
Hopper TMA kernels with Triton >= 3.4). Its window branch calls the flash-attn package; without
it the adapter gives `flash_nsa.modules.megatron_level_nsa` the stand-in of bench/peers/window.py
(torch's bundled FlashAttention-2, the same kernel code), which the benchmark also times alone.
A forced selection replaces its `slc_topk_indices` (our blocks in its form [G, T, 16], unused
slots = the number of selection blocks, its own padding).

Decode: `flash_nsa.inference.nsa_decode` (its serving path: paged K/V of 128-token pages,
compressed K/V in pages of the same pool, the fused selected + window kernel), for the query at
position S - 1 over a cache of S tokens, with no compressed block emitted at that step
(`cmp_slot_mapping` -1, as in 15 of 16 steps); CUDA-graph capturable, as its own benchmark does
with `fixed_num_slc_blocks` = S / 64 and `fixed_y_maxlen` = S / 16.
"""
from __future__ import annotations

import math
from typing import Optional

from bench.peers import (DecodeCase, RecordsSelection, cu_seqlens, ensure_pkg_resources,
                         flash_window_config, from_heads_first, heads_first, import_from,
                         mean_pool, packed, window, window_alone)

NAME = "mdy666"
REPO = "mdy666/Scalable-Flash-Native-Sparse-Attention"
HEADS = (64, 4)
D_MODEL = 4096
HEAD_DIM = 128
KERNEL, STRIDE, BLOCK, TOP_N, N_INIT, N_LOCAL, WINDOW = 32, 16, 64, 16, 1, 2, 512
PAGE = 128  # its decode's K/V page (nsa_decode asserts a multiple of 128)


def config(heads: Optional[tuple[int, int]] = None):
    """Our NSAConfig in mdy666's configuration (its window of 512 is 513 keys: w = 513)."""
    return flash_window_config(heads or HEADS, d_model=D_MODEL, head_dim=HEAD_DIM,
                               kernel=KERNEL, stride=STRIDE, block=BLOCK, top_n=TOP_N,
                               n_init=N_INIT, n_local=N_LOCAL, window_left=WINDOW)


def notes(cfg) -> str:
    return ("flash_nsa.NSACore; window branch: flash-attn stand-in (bench/peers/window.py), "
            "timed alone as window_standin; decode: flash_nsa.inference.nsa_decode")


def load(path: Optional[str], cfg) -> "Peer":
    return Peer(path, cfg)


class Peer(RecordsSelection):
    def __init__(self, path: Optional[str], cfg):
        self.cfg = cfg
        ensure_pkg_resources()
        self.flash_nsa = import_from(path, "flash_nsa")
        import flash_nsa.inference as inference
        import flash_nsa.modules.megatron_level_nsa as megatron
        import flash_nsa.ops.sliding_window_attention as sliding_window
        import triton

        from bench.common import Skip

        if not self.flash_nsa.NSAHelper.is_triton34():
            raise Skip(f"its Megatron-level kernels need Triton >= 3.4 (this: "
                       f"{triton.__version__})")
        self.inference = inference
        self.megatron = megatron
        self.cores = {}
        self.impl = "flash_nsa.NSACore (Megatron level)"
        if sliding_window.HAVE_FA3 or sliding_window.HAVE_FA2:
            self.window_label = "flash-attn"
        else:
            self._install_window()

    # -- window stand-in ----------------------------------------------------------------------
    def _install_window(self) -> None:
        helper_cls = self.flash_nsa.NSAHelper

        def swa_fwd(q, k, v, sm_scale=None, out=None, helper=helper_cls):
            o, lse = window.forward(q, k, v, helper.x_cu_seqlens, helper.x_maxlen,
                                    helper_cls.window_size, sm_scale)
            if out is not None:
                out.copy_(o)
                o = out
            return o, lse

        def swa_bwd(q, k, v, out, lse, dout, sm_scale=None, helper=helper_cls):
            return window.backward(dout, q, k, v, out, lse, helper.x_cu_seqlens, helper.x_maxlen,
                                   helper_cls.window_size, sm_scale)

        self.megatron.swa_fwd = swa_fwd
        self.megatron.swa_bwd = swa_bwd
        self.window_label = "stand-in"

    def window(self, q, k, v):
        """The stand-in alone on BTHD tensors ([B, S, H, d_v]); None when flash-attn runs."""
        return window_alone(q, k, v, WINDOW) if self.window_label == "stand-in" else None

    # -- prefill ------------------------------------------------------------------------------
    def _core(self, H: int, G: int):
        if (H, G) not in self.cores:
            peer_cfg = self.flash_nsa.NSAConfig(
                head_dim=HEAD_DIM, num_heads=H, num_kv_heads=G, kernel_size=KERNEL,
                stride=STRIDE, block_size=BLOCK, top_n=TOP_N, num_init_blocks=N_INIT,
                num_local_blocks=N_LOCAL, window_size=WINDOW)
            self.cores[(H, G)] = self.flash_nsa.NSACore(peer_cfg, process_group=None, pp_size=1)
        return self.cores[(H, G)]

    def prefill(self, q, k, v, gate_logits, block_idx=None):
        B, S, H, _ = q.shape
        core = self._core(H, k.shape[2])
        forced = None if block_idx is None else heads_first(block_idx.to(q.device),
                                                            fill=math.ceil(S / BLOCK))
        topk = self.megatron.slc_topk_indices

        def select(*args, **kwargs):
            out = (forced, None) if forced is not None else topk(*args, **kwargs)
            self.used = (out[0], B, S)
            return out

        self.megatron.slc_topk_indices = select
        try:
            o = core(packed(q), packed(k), packed(v), packed(gate_logits),
                     cu_seqlens(B, S, q.device))
        finally:
            self.megatron.slc_topk_indices = topk
        return o.reshape(B, S, H, -1)

    # -- decode -------------------------------------------------------------------------------
    def decode_case(self, k, v, q_last, gate_last, block_idx=None) -> DecodeCase:
        """nsa_decode for the query at S - 1 over k / v [B, S, G, d] (S a multiple of 128)."""
        import torch

        from bench.common import Skip

        B, S, G, D = k.shape
        if S % PAGE:
            raise Skip(f"its decode pages K/V by {PAGE} tokens: S ({S}) must be a multiple")
        n_cmp = (S - KERNEL) // STRIDE + 1
        pages, cmp_pages = S // PAGE, math.ceil(n_cmp / PAGE)
        device, total = k.device, B * (pages + cmp_pages)
        caches = []
        for x in (k, v):
            cache = torch.zeros(total, PAGE, G, x.shape[-1], device=device, dtype=x.dtype)
            cache[:B * pages].view(B, S, G, -1).copy_(x)
            cache[B * pages:].view(B, cmp_pages * PAGE, G, -1)[:, :n_cmp].copy_(
                mean_pool(x, KERNEL, STRIDE))
            caches.append(cache)
        k_cache, v_cache = caches
        block_tables = torch.arange(B * pages, device=device, dtype=torch.int32).view(B, pages)
        cmp_tables = (B * pages + torch.arange(B * cmp_pages, device=device,
                                               dtype=torch.int32)).view(B, cmp_pages)
        context_lens = torch.full((B,), S, device=device, dtype=torch.int32)
        no_emit = torch.full((B,), -1, device=device, dtype=torch.int32)
        q_last, gate_last = q_last.contiguous(), gate_last.contiguous()
        used = {}
        inference = self.inference
        topk_decode = inference.topk_decode
        forced = (None if block_idx is None
                  else block_idx.to(device=device, dtype=torch.int32).permute(1, 0, 2).contiguous())

        def select(*args, **kwargs):
            used["idx"] = forced if forced is not None else topk_decode(*args, **kwargs)
            return used["idx"]

        def step():
            inference.topk_decode = select
            try:
                return inference.nsa_decode(
                    q_last, k_cache, v_cache, gate_last, context_lens, block_tables, no_emit,
                    cmp_tables, fixed_y_maxlen=S // STRIDE,
                    fixed_num_slc_blocks=math.ceil(S / BLOCK), kernel_size=KERNEL,
                    stride=STRIDE, block_size=BLOCK, top_n=TOP_N, num_init_blocks=N_INIT,
                    num_local_blocks=N_LOCAL, window_size=WINDOW, sm_scale=D ** -0.5)
            finally:
                inference.topk_decode = topk_decode

        def selected():
            # Its decode form [G, B, top_n], -1 unused, in score order.
            return from_heads_first(used["idx"], B, 1, TOP_N, BLOCK, first=S - 1)[:, 0]

        return DecodeCase(step=step, block_idx=selected, graphable=True,
                          note="paged K/V, no compressed block emitted at the step")
