"""Non-finite isolation in the torch Triton selection kernel (docs/ROBUSTNESS.md), under the
Triton interpreter on a CPU (compiled on a GPU): its tiles load whole blocks, also the tokens
past the query, so a NaN there must not reach the query through a zero weight."""
import pytest
import torch

# The interpreter set-up (TRITON_INTERPRET, module reload, skip) lives in that module.
from test_torch_triton_selection import DEVICE, ts

# Tiny: the interpreter runs every program in Python. Query 17 loads block 1 = [16, 32).
T, BAD, L_SEL, N_SEL = 24, 18, 16, 2
B, G, H, D = 1, 2, 2, 16
TOL = 1e-6  # float32, same finite values on both runs


def all_blocks(starts):
    """block_idx [B, T, G, N_SEL]: every block of the query's sequence up to its own (local)."""
    local_last = (torch.arange(T) - starts) // L_SEL
    idx = torch.arange(N_SEL)[None, :].expand(T, N_SEL)
    idx = torch.where(idx <= local_last[:, None], idx, -1)
    return idx[None, :, None, :].expand(B, T, G, N_SEL).to(torch.int32).contiguous()


def run(q, k, v, block_idx, keep, cu_seqlens=None):
    leaves = [a.clone().to(DEVICE).requires_grad_(True) for a in (q, k, v)]
    o = ts.selected_attention_triton(*leaves, block_idx.to(DEVICE), L_SEL,
                                     cu_seqlens=cu_seqlens)
    o[:, keep].sum().backward()
    return o.detach().cpu(), [a.grad.cpu() for a in leaves]


def assert_same(dirty, clean, what):
    assert torch.isfinite(dirty).all(), f"{what}: non-finite where the clean run is finite"
    torch.testing.assert_close(dirty, clean, rtol=TOL, atol=TOL, msg=what)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_triton_selection_isolates_nonfinite_tokens(packed):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, n, D, generator=gen) for n in (H, G, G))
    cu = torch.tensor([0, 8, T], dtype=torch.int32, device=DEVICE) if packed else None
    starts = torch.where(torch.arange(T) >= 8, 8, 0) if packed else torch.zeros(T, dtype=torch.long)
    bad = 20 if packed else BAD  # packed: mid second sequence, whose block 0 is [8, 24)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, bad, 0, 3] = float("nan")
    v_bad[0, bad, 1, 0] = float("inf")
    keep = torch.arange(T) < bad
    block_idx = all_blocks(starts)
    o, grads = run(q, k, v, block_idx, keep, cu)
    o_bad, grads_bad = run(q, k_bad, v_bad, block_idx, keep, cu)
    assert_same(o_bad[:, keep], o[:, keep], "o before the bad token")
    assert not torch.isfinite(o_bad[:, bad]).all()
    assert_same(grads_bad[0], grads[0], "dq")
    others = torch.arange(T) != bad
    assert_same(grads_bad[1][:, others], grads[1][:, others], "dk")
    assert_same(grads_bad[2][:, others], grads[2][:, others], "dv")
