"""GPU matrix, non-finite isolation of the torch fast paths (docs/ROBUSTNESS.md): the compiled
Triton selection kernel and the FA-2 kernels, at sizes where tiles hold many tokens. A NaN key
at token t: rows before t are bit-identical to the clean run, rows that see it are NaN, and a
loss over the rows before t gets the clean gradients (within the tolerance: the kernels'
backward may accumulate in a run-dependent order).
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import GPU, tol_for
from nsa_common.testing import rel_err
from nsa_common import NSAConfig, num_cmp_blocks

pytestmark = GPU

if torch.cuda.is_available():
    from nsa_torch_ref.fast import fa2, triton_selection

CFG = NSAConfig(n_heads=16, n_kv_heads=2, d_k=128, d_v=128, cmp_block=32, cmp_stride=16,
                sel_block=64, n_sel=8, window=256)
T = 1024


def run(fn, q, k, v, first_seen):
    leaves = [a.clone().requires_grad_(True) for a in (q, k, v)]
    o = fn(*leaves)
    o[:, :first_seen].float().sum().backward()
    return o.detach(), [a.grad for a in leaves]


def check_isolated(fn, q, k, v, bad, first_seen):
    k_bad = k.clone()
    k_bad[0, bad, 0, 5] = float("nan")
    o, grads = run(fn, q, k, v, first_seen)
    o_bad, grads_bad = run(fn, q, k_bad, v, first_seen)
    assert torch.isfinite(o_bad[:, :first_seen]).all()
    assert torch.equal(o_bad[:, :first_seen], o[:, :first_seen])
    assert not torch.isfinite(o_bad[:, first_seen]).all()
    tol = tol_for(q.dtype, grad=True)
    assert rel_err(grads_bad[0], grads[0]) <= tol, "dq"
    keep = torch.arange(k.shape[1], device=k.device) != bad
    for name, g_bad, g in zip(("dk", "dv"), grads_bad[1:], grads[1:]):
        assert rel_err(g_bad[:, keep], g[:, keep]) <= tol, name


def inputs(S, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H, G = CFG.n_heads, CFG.n_kv_heads
    q = torch.randn(1, T, H, CFG.d_k, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1, S, G, CFG.d_k, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, S, G, CFG.d_v, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa2_window_isolates_nonfinite(dtype):
    q, k, v = inputs(T, dtype)
    fn = lambda q, k, v: fa2.sliding_window_attention_fa2(q, k, v, CFG.window)  # noqa: E731
    check_isolated(fn, q, k, v, bad=600, first_seen=600)


def test_fa2_window_packed_isolates_nonfinite():
    q, k, v = inputs(T, torch.bfloat16, seed=1)
    cu = torch.tensor([0, 500, T], dtype=torch.int32, device="cuda")
    fn = lambda q, k, v: fa2.sliding_window_attention_fa2(q, k, v, CFG.window,  # noqa: E731
                                                          cu_seqlens=cu)
    check_isolated(fn, q, k, v, bad=501, first_seen=501)


def test_fa2_compressed_isolates_nonfinite():
    C = num_cmp_blocks(CFG, T)
    q, k, v = inputs(C, torch.bfloat16, seed=2)
    fn = lambda q, k, v: fa2.compressed_attention_fa2(q, k, v, CFG)  # noqa: E731
    bad = 40  # block 40 = tokens [640, 672), first seen by query 671
    check_isolated(fn, q, k, v, bad=bad, first_seen=bad * CFG.cmp_stride + CFG.cmp_block - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_selection_isolates_nonfinite(dtype):
    q, k, v = inputs(T, dtype, seed=3)
    l_sel, n_sel = CFG.sel_block, CFG.n_sel
    own = torch.arange(T, device="cuda") // l_sel
    # The n_sel most recent blocks of each query: block 9 = [576, 640) is partial for 600..639.
    idx = own[:, None] - torch.arange(n_sel - 1, -1, -1, device="cuda")[None, :]
    idx = torch.where(idx >= 0, idx, T).sort(dim=-1).values   # ascending, -1 padding last
    idx = torch.where(idx == T, -1, idx)
    block_idx = idx[None, :, None, :].expand(1, T, CFG.n_kv_heads, n_sel).int().contiguous()
    fn = lambda q, k, v: triton_selection.selected_attention_triton(  # noqa: E731
        q, k, v, block_idx, l_sel)
    check_isolated(fn, q, k, v, bad=610, first_seen=610)
