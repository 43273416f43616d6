"""GPU matrix, selection branch: Triton selected attention against the reference ("sdpa").

Forward parity and backward parity over head counts, head dims (d_k != d_v, non powers of two),
dtypes, block_idx from the real selection, packed sequences; determinism of dk/dv; a long
sequence with B*T*H*d > 2**31 (int64 offsets); a finite-difference gradcheck.
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import GPU, tol_for
from nsa_common.testing import rel_err
from nsa_common import NSAConfig

pytestmark = GPU

if torch.cuda.is_available():
    from nsa_torch_ref import reference
    from nsa_torch_ref.fast.triton_selection import selected_attention_triton


def _inputs(cfg: NSAConfig, B: int, T: int, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H, G = cfg.n_heads, cfg.n_kv_heads
    q = torch.randn(B, T, H, cfg.d_k, device="cuda", generator=gen)
    k = torch.randn(B, T, G, cfg.d_k, device="cuda", generator=gen)
    v = torch.randn(B, T, G, cfg.d_v, device="cuda", generator=gen)
    k_cmp = reference.compress_kv(k, None, cfg.replace(compress="mean"))
    block_idx = reference.select_blocks(q, k_cmp, cfg)
    return [x.to(dtype) for x in (q, k, v)], block_idx


CONFIGS = [
    pytest.param(NSAConfig(n_heads=4, n_kv_heads=4, d_k=64, d_v=64, n_sel=4, window=64), id="h1"),
    pytest.param(NSAConfig(n_heads=16, n_kv_heads=2, d_k=96, d_v=40, n_sel=8), id="h8-dk96-dv40"),
    pytest.param(NSAConfig(n_heads=32, n_kv_heads=1, d_k=128, d_v=128), id="h32"),
    pytest.param(NSAConfig.paper(), id="paper-dk192-dv128"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_parity(cfg, dtype):
    (q, k, v), idx = _inputs(cfg, 2, 1024, dtype)
    out = selected_attention_triton(q, k, v, idx, cfg.sel_block)
    ref = reference.selected_attention(q.float(), k.float(), v.float(), idx, cfg.sel_block)
    assert out.dtype == dtype
    assert rel_err(out, ref) < tol_for(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_backward_parity(cfg, dtype):
    (q, k, v), idx = _inputs(cfg, 1, 768, dtype, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = selected_attention_triton(*leaves, idx, cfg.sel_block)
    ref = reference.selected_attention(*leaves32, idx, cfg.sel_block)
    grad = torch.randn_like(ref)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for name, a, b in zip("qkv", leaves, leaves32):
        assert rel_err(a.grad, b.grad) < tol_for(dtype, grad=True), name


def test_packed_sequences():
    cfg = NSAConfig(n_heads=8, n_kv_heads=2, d_k=64, d_v=64, n_sel=4)
    bounds = [0, 300, 301, 900]
    (q, k, v), _ = _inputs(cfg, 1, bounds[-1], torch.bfloat16)
    idx = torch.cat([reference.select_blocks(q[:, a:b].float(),
                                             reference.compress_kv(k[:, a:b].float(), None,
                                                                   cfg.replace(compress="mean")),
                                             cfg) for a, b in zip(bounds, bounds[1:])], dim=1)
    out = selected_attention_triton(q, k, v, idx, cfg.sel_block,
                                    cu_seqlens=torch.tensor(bounds, device="cuda"))
    ref = torch.cat([reference.selected_attention(q[:, a:b].float(), k[:, a:b].float(),
                                                  v[:, a:b].float(), idx[:, a:b], cfg.sel_block)
                     for a, b in zip(bounds, bounds[1:])], dim=1)
    assert rel_err(out, ref) < tol_for(torch.bfloat16)


def test_backward_is_deterministic():
    cfg = NSAConfig(n_heads=8, n_kv_heads=2, d_k=64, d_v=64)
    (q, k, v), idx = _inputs(cfg, 2, 2048, torch.bfloat16, seed=3)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        selected_attention_triton(*leaves, idx, cfg.sel_block).float().square().sum().backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_long_sequence_int64_offsets():
    # B*T*H*d_k = 1 * 2**17 * 64 * 256 = 2**31: 32-bit offsets would wrap past the middle.
    cfg = NSAConfig(n_heads=64, n_kv_heads=1, d_k=256, d_v=64, sel_block=64, n_sel=4)
    T = 1 << 17
    torch.manual_seed(0)
    q = torch.randn(1, T, cfg.n_heads, cfg.d_k, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, 1, cfg.d_k, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, 1, cfg.d_v, device="cuda", dtype=torch.bfloat16)
    t = torch.arange(T, device="cuda")
    last = (t // cfg.sel_block)[:, None]
    # First block, two local blocks and one pseudo-random block in between, ascending.
    middle = (t * 7919 % (last[:, 0] + 1).clamp(min=1))[:, None]
    idx = torch.cat([torch.zeros_like(last), middle, (last - 1).clamp(min=0), last], 1)
    idx = torch.sort(idx, 1).values
    dup = torch.cat([torch.zeros_like(idx[:, :1], dtype=torch.bool), idx[:, 1:] == idx[:, :-1]], 1)
    idx = torch.where(dup, torch.full_like(idx, 1 << 30), idx)
    idx = torch.sort(idx, 1).values
    idx = torch.where(idx == 1 << 30, -1, idx).int()[None, :, None, :]
    out = selected_attention_triton(q, k, v, idx, cfg.sel_block)
    rows = torch.tensor([0, 1, 4095, T // 2 - 1, T // 2, T - 2, T - 1], device="cuda")
    ref = reference._selected_rows(q[:, rows].float(), k.float(), v.float(), idx[:, rows],
                                   cfg.sel_block, rows, cfg.d_k ** -0.5)
    assert rel_err(out[:, rows], ref) < tol_for(torch.bfloat16)


def test_gradcheck_finite_differences():
    """Directional finite differences of the Triton kernel against its own backward.

    `torch.autograd.gradcheck` needs float64, which the kernel does not take; elementwise float32
    differences are noise-bound. A directional derivative of a scalar loss, with a central
    difference and a large step, is accurate to ~1e-3 in float32."""
    cfg = NSAConfig(n_heads=4, n_kv_heads=2, d_k=16, d_v=24, cmp_block=16, cmp_stride=8,
                    sel_block=16, n_sel=3)
    (q, k, v), idx = _inputs(cfg, 1, 80, torch.float32, seed=5)
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(q.shape[:3] + (cfg.d_v,), device="cuda", generator=generator)

    def loss(*inputs):
        return (selected_attention_triton(*inputs, idx, cfg.sel_block).double() * weight).sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss(*leaves).backward()
    for i, name in enumerate(("q", "k", "v")):
        direction = torch.randn(leaves[i].shape, device="cuda", generator=generator)
        eps = 1e-2
        plus = [x.detach() + (eps * direction if j == i else 0) for j, x in enumerate(leaves)]
        minus = [x.detach() - (eps * direction if j == i else 0) for j, x in enumerate(leaves)]
        numeric = (loss(*plus) - loss(*minus)).item() / (2 * eps)
        analytic = (leaves[i].grad.double() * direction).sum().item()
        assert abs(numeric - analytic) <= 1e-2 * max(1.0, abs(analytic)), (name, numeric, analytic)
