"""GPU matrix, FA-2 paths: window and compressed branches, dense and varlen, forward and
backward, against the reference ("sdpa"). Each test checks that a kernel ran (the reference
fallbacks are patched to fail), except where this torch cannot express the call, which skips
with the reason.
"""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import GPU, tol_for
from nsa_common.testing import rel_err
from nsa_common import NSAConfig, num_cmp_blocks

pytestmark = GPU

if torch.cuda.is_available():
    from nsa_torch_ref import reference
    from nsa_torch_ref.fast import fa2, runtime

    COMPRESSED_REFERENCE = fa2._compressed_reference

CFG = NSAConfig(n_heads=16, n_kv_heads=2, d_k=192, d_v=128, cmp_block=32, cmp_stride=16,
                sel_block=64, window=256)
VARIANTS = [None, "NSA_FA2_FORCE_VARLEN", "NSA_FA2_FORCE_DENSE"]


@pytest.fixture
def kernels_only(monkeypatch):
    """Clean toggles; the reference fallbacks raise, so a silent fallback fails the test."""
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)

    def no_fallback(*args, **kwargs):
        raise AssertionError("FA-2 path fell back to the reference")

    monkeypatch.setattr(fa2, "_window_reference", no_fallback)
    monkeypatch.setattr(fa2, "_compressed_reference", no_fallback)
    return monkeypatch


def _needs_window_kernel():
    found = fa2.versions()
    if found["flash_attn"] is None and not found["torch_varlen_window"]:
        pytest.skip("no flash_attn and this torch's varlen_attn has no window_size")


def _qkv(B, T, dtype=torch.bfloat16, seed=0, cfg=CFG):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)  # noqa: E731
    return (mk(B, T, cfg.n_heads, cfg.d_k), mk(B, T, cfg.n_kv_heads, cfg.d_k),
            mk(B, T, cfg.n_kv_heads, cfg.d_v))


def _cmp_kv(k, v, bounds, cfg=CFG):
    mean = cfg.replace(compress="mean")
    return (torch.cat([reference.compress_kv(k[:, a:b], None, mean)
                       for a, b in zip(bounds, bounds[1:])], 1),
            torch.cat([reference.compress_kv(v[:, a:b], None, mean)
                       for a, b in zip(bounds, bounds[1:])], 1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [200, 1000])
def test_window_dense(kernels_only, variant, T):
    _needs_window_kernel()
    if variant:
        kernels_only.setenv(variant, "1")
    q, k, v = _qkv(2, T)
    out = fa2.sliding_window_attention_fa2(q, k, v, CFG.window)
    ref = reference.sliding_window_attention(q.float(), k.float(), v.float(), CFG.window)
    assert rel_err(out, ref) < tol_for(torch.bfloat16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_window_varlen(kernels_only, variant):
    _needs_window_kernel()
    if variant:
        kernels_only.setenv(variant, "1")
    bounds = [0, 100, 700, 701, 1500]
    q, k, v = _qkv(1, bounds[-1], seed=1)
    out = fa2.sliding_window_attention_fa2(q, k, v, CFG.window,
                                           cu_seqlens=torch.tensor(bounds, device="cuda"))
    ref = torch.cat([reference.sliding_window_attention(q[:, a:b].float(), k[:, a:b].float(),
                                                        v[:, a:b].float(), CFG.window)
                     for a, b in zip(bounds, bounds[1:])], 1)
    assert rel_err(out, ref) < tol_for(torch.bfloat16)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [31, 32, 47, 1000])
def test_compressed_dense(kernels_only, variant, T):
    if variant:
        kernels_only.setenv(variant, "1")
    if num_cmp_blocks(CFG, T) == 0:  # nothing to attend: the reference path is the answer
        kernels_only.setattr(fa2, "_compressed_reference", COMPRESSED_REFERENCE)
    q, k, v = _qkv(2, T, seed=2)
    k_cmp, v_cmp = _cmp_kv(k, v, [0, T])
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG)
    ref = reference.compressed_attention(q.float(), k_cmp.float(), v_cmp.float(), CFG)
    assert torch.all(out[:, :CFG.cmp_block - 1] == 0)
    if num_cmp_blocks(CFG, T):
        assert rel_err(out, ref) < tol_for(torch.bfloat16)
    else:
        assert torch.all(out == 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compressed_varlen(kernels_only, variant):
    if variant:
        kernels_only.setenv(variant, "1")
    bounds = [0, 20, 500, 533, 1400]  # the first sequence has no compressed block
    q, k, v = _qkv(1, bounds[-1], seed=3)
    k_cmp, v_cmp = _cmp_kv(k, v, bounds)
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG,
                                       cu_seqlens=torch.tensor(bounds, device="cuda"))
    parts, offset = [], 0
    for a, b in zip(bounds, bounds[1:]):
        n = num_cmp_blocks(CFG, b - a)
        parts.append(reference.compressed_attention(q[:, a:b].float(), k_cmp[:, offset:offset + n]
                                                    .float(), v_cmp[:, offset:offset + n].float(),
                                                    CFG))
        offset += n
    assert rel_err(out, torch.cat(parts, 1)) < tol_for(torch.bfloat16)


@pytest.mark.parametrize("branch", ["window", "compressed"])
def test_backward_parity(kernels_only, branch):
    if branch == "window":
        _needs_window_kernel()
    q, k, v = _qkv(1, 700, seed=4)
    if branch == "compressed":
        k, v = _cmp_kv(k, v, [0, 700])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    if branch == "window":
        out = fa2.sliding_window_attention_fa2(*leaves, CFG.window)
        ref = reference.sliding_window_attention(*leaves32, CFG.window)
    else:
        out = fa2.compressed_attention_fa2(*leaves, CFG)
        ref = reference.compressed_attention(*leaves32, CFG)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for name, a, b in zip("qkv", leaves, leaves32):
        assert rel_err(a.grad, b.grad) < tol_for(torch.bfloat16, grad=True), name


def test_float32_falls_back_exactly(monkeypatch):
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)
    q, k, v = _qkv(1, 300, dtype=torch.float32)
    assert fa2.kernel_choice(q, 192)[0] == "reference"
    out = fa2.sliding_window_attention_fa2(q, k, v, CFG.window)
    assert torch.equal(out, reference.sliding_window_attention(q, k, v, CFG.window))
