"""The stand-in for flash-attn's sliding window, for peers whose window branch calls the
flash-attn package (absent on the benchmark machine).

What it computes is flash-attn's `flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
causal=True, window_size=(left, -1))` on packed tensors q [T, H, d], k / v [T, G, d]: query t
of a sequence attends that sequence's keys t - left .. t (left + 1 keys), grouped heads
(head i reads KV head i // (H / G)). Kernels:
- on CUDA in float16 / bfloat16: torch's bundled FlashAttention-2
  (`torch.ops.aten._flash_attention_forward` / `_backward` with `window_size_left`), the kernel
  code of flash-attn 2 itself; K / V are repeated to H heads if this torch refuses grouped heads
  (the repeat is then part of the stand-in's time);
- elsewhere: a dense masked reference (small sizes: the CPU tests).
The benchmark times the stand-in on its own too, so that its share can be taken out of a
peer's time.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
_EXPAND = {"needed": None}   # None: not yet known whether this torch takes grouped heads
_SAVED: dict[int, tuple] = {}  # lse.data_ptr() -> (rng_state, unused) of the forward


def kernel(q: torch.Tensor) -> str:
    """"flash" (torch's FlashAttention-2) or "reference" for tensors like q."""
    if q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256:
        return "flash"
    return "reference"


def label(q: torch.Tensor) -> str:
    if kernel(q) == "flash":
        return "torch FlashAttention-2 (aten._flash_attention_forward, window_size_left)"
    return "dense masked reference"


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _flash_forward(q, k, v, cu, max_len, left, scale):
    def call(k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=0)

    if _EXPAND["needed"] is None and k.shape[1] != q.shape[1]:
        try:
            out = call(k, v)
            _EXPAND["needed"] = False
        except RuntimeError:
            _EXPAND["needed"] = True
            out = call(_repeat(k, q.shape[1]), _repeat(v, q.shape[1]))
    elif _EXPAND["needed"]:
        out = call(_repeat(k, q.shape[1]), _repeat(v, q.shape[1]))
    else:
        out = call(k, v)
    o, lse, rng_state, unused = out[0], out[1], out[2], out[3]
    if len(_SAVED) > 64:  # forwards run without a backward (timing) leave theirs behind
        _SAVED.clear()
    _SAVED[lse.data_ptr()] = (rng_state, unused)
    return o, lse


def _flash_backward(dout, q, k, v, o, lse, cu, max_len, left, scale):
    if lse.data_ptr() not in _SAVED:
        raise RuntimeError("window stand-in: backward without its forward's state")
    rng_state, unused = _SAVED.pop(lse.data_ptr())
    groups = q.shape[1] // k.shape[1]

    def call(k, v):
        return torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, o, lse, cu, cu, max_len, max_len, 0.0, True, rng_state,
            unused, scale=scale, window_size_left=left, window_size_right=0)

    expand = groups > 1 and (_EXPAND["needed"] or _EXPAND.get("backward"))
    if groups > 1 and not expand:
        try:
            return call(k, v)
        except RuntimeError:  # this torch's backward refuses grouped heads
            _EXPAND["backward"] = expand = True
    if not expand:
        return call(k, v)
    dq, dk, dv = call(_repeat(k, q.shape[1]), _repeat(v, q.shape[1]))
    T, G = k.shape[:2]
    return (dq, dk.reshape(T, G, groups, dk.shape[-1]).sum(2),
            dv.reshape(T, G, groups, dv.shape[-1]).sum(2))


def _reference(q, k, v, cu, left, scale):
    """o [T, H, d_v] and lse [H, T] (natural log) of the windowed causal attention."""
    H = q.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32 at least
    outs, lses = [], []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].to(dtype).transpose(0, 1)                   # [H, s, d]
        ks = _repeat(k[a:b], H).to(dtype).transpose(0, 1)
        vs = _repeat(v[a:b], H).to(dtype).transpose(0, 1)
        i = torch.arange(b - a, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
        scores = torch.where(mask, qs @ ks.transpose(1, 2) * scale, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                   # [H, s]
        outs.append((torch.exp(scores - lse[..., None]) @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def forward(q, k, v, cu, max_len: int, left: int, scale: Optional[float] = None):
    """(o [T, H, d_v], lse) of the window; lse is what `backward` needs back."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kernel(q) == "flash":
        return _flash_forward(q, k, v, cu, max_len, left, scale)
    return _reference(q, k, v, cu, left, scale)


def backward(dout, q, k, v, o, lse, cu, max_len: int, left: int, scale: Optional[float] = None):
    """(dq, dk, dv) of the window, from the forward's o and lse."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kernel(q) == "flash":
        return _flash_backward(dout, q, k, v, o, lse, cu, max_len, left, scale)
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out, _ = _reference(*leaves, cu, left, scale)
        return torch.autograd.grad(out, leaves, dout)


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, left, scale):
        o, lse = forward(q, k, v, cu, max_len, left, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu)
        ctx.args = (max_len, left, scale)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, cu = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, o, lse, cu, *ctx.args)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, cu, max_len: int, left: int, scale: Optional[float] = None):
    """The window as a differentiable function: o [T, H, d_v]."""
    return _Window.apply(q, k, v, cu, max_len, left, scale)


def decode(q_last, k, v, left: int, scale: Optional[float] = None):
    """The window of one query per sequence at position S - 1: q_last [B, H, d], k / v
    [B, S, G, d] -> [B, H, d_v] (keys S - 1 - left .. S - 1), through SDPA."""
    scale = 1 / math.sqrt(q_last.shape[-1]) if scale is None else scale
    S, H = k.shape[1], q_last.shape[1]
    keys = slice(max(0, S - 1 - left), S)
    kk = k[:, keys].transpose(1, 2)
    vv = v[:, keys].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_last[:, :, None], kk, vv, scale=scale, enable_gqa=H != k.shape[2])
    return out[:, :, 0]
