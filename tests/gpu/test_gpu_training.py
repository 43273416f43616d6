"""GPU matrix, training smokes: the layer with every fast path forced ("auto" backends with
NSA_TRITON_SEL_FORCE and NSA_FA2_FORCE_DENSE / _VARLEN) trains under bf16 autocast: a few AdamW
steps lower the loss, every gradient is finite, and the first step's gradients match the
reference layer's.
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import GPU
from nsa_common.testing import rel_err
from nsa_common import NSAConfig

pytestmark = GPU

if torch.cuda.is_available():
    from nsa_torch_ref import NSAAttention
    from nsa_torch_ref.fast import routing, runtime

CFG = NSAConfig(d_model=256, n_heads=8, n_kv_heads=2, d_k=64, d_v=64, cmp_block=32,
                cmp_stride=16, sel_block=32, n_sel=4, window=64)


@pytest.fixture
def forced(monkeypatch):
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)
    monkeypatch.setenv("NSA_TRITON_SEL_FORCE", "1")
    routing.register_fast_paths()
    return monkeypatch


def _layers(seed=0):
    torch.manual_seed(seed)
    fast = NSAAttention(CFG, backends={b: "auto" for b in routing.BRANCHES}).cuda()
    plain = NSAAttention(CFG).cuda()
    plain.load_state_dict(fast.state_dict())
    return fast, plain


def _grads(layer, x, target):
    layer.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (layer(x).float() - target).square().mean()
    loss.backward()
    return loss, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("variant", ["NSA_FA2_FORCE_DENSE", "NSA_FA2_FORCE_VARLEN"])
def test_first_step_gradients_match_reference(forced, variant):
    forced.setenv(variant, "1")
    fast, plain = _layers()
    x = torch.randn(2, 320, CFG.d_model, device="cuda")
    target = torch.randn(2, 320, CFG.d_model, device="cuda")
    loss_fast, g_fast = _grads(fast, x, target)
    loss_plain, g_plain = _grads(plain, x, target)
    assert abs(loss_fast.item() - loss_plain.item()) < 1e-2 * loss_plain.item()
    typical = torch.stack([g.norm() for g in g_plain.values()]).median()
    for name in g_plain:
        assert torch.isfinite(g_fast[name]).all(), name
        if name == "cmp_k.b2":
            # cmp_k.b2 shifts every compressed key of a group alike, which adds q.b2 to all of
            # a query's compressed scores: the softmax ignores it, its gradient is exactly 0
            # and both sides hold only rounding noise (~1e-7), so no ratio is meaningful.
            assert g_fast[name].norm() < 1e-3 * typical, name
            continue
        assert rel_err(g_fast[name], g_plain[name]) < 5e-2, name  # bf16 autocast end to end


def test_loss_decreases(forced):
    forced.setenv("NSA_FA2_FORCE_DENSE", "1")
    fast, _ = _layers(seed=1)
    opt = torch.optim.AdamW(fast.parameters(), lr=3e-3)
    x = torch.randn(2, 256, CFG.d_model, device="cuda")
    target = torch.randn(2, 256, CFG.d_model, device="cuda") * 0.5
    losses = []
    for _ in range(8):
        loss, grads = _grads(fast, x, target)
        assert all(torch.isfinite(g).all() for g in grads.values())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses


def test_packed_training_step(forced):
    forced.setenv("NSA_FA2_FORCE_VARLEN", "1")
    fast, plain = _layers(seed=2)
    cu = torch.tensor([0, 100, 260], device="cuda", dtype=torch.int32)
    x = torch.randn(1, 260, CFG.d_model, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_fast = fast(x, cu_seqlens=cu)
        y_plain = plain(x, cu_seqlens=cu)
    assert rel_err(y_fast, y_plain) < 2e-2
    y_fast.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in fast.parameters())
