"""FA-2 paths (nsa_torch_ref/fast/fa2.py) on CPU: path selection and argument translation.

No FlashAttention kernel runs on CPU, so the kernels are replaced by stand-ins that implement
their documented semantics with explicit masks (flash_attn's `causal` is bottom-right aligned,
`window_size=(left, right)` keeps keys `i + Sk - Sq - left .. i + Sk - Sq + right`). What is
tested is ours: the window translation, the compressed-branch fold, padding of head dims,
packing, the dense/varlen choice and the fallbacks. Results are compared with the float64
brute force (tests/bruteforce.py). The real kernels run in tests/gpu/.
"""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from bruteforce import bf_compressed_attention, bf_sliding_window_attention
from nsa_common import NSAConfig, num_cmp_blocks
from nsa_common.testing import rel_err
from nsa_torch_ref import reference
from nsa_torch_ref.fast import fa2, runtime

TOL = 1e-5  # float32 path against the float64 brute force (relative error)
CFG = NSAConfig.tiny()  # l = 8, d = 4, d_k = 16, d_v = 8, H = 4, G = 2


def _masked(q, k, v, mask, scale):
    """q [Sq, Hq, D], k, v [Sk, Hk, D], mask [Sq, Sk] -> [Sq, Hq, D]; empty rows give 0."""
    reps = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).to(q.dtype)


def _flash_mask(sq, sk, causal, window_size):
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window_size
    if causal:
        right = 0
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


class FakeFlashAttn(types.SimpleNamespace):
    """flash_attn's two entry points, by their documented semantics, recording each call."""

    def __init__(self):
        super().__init__(calls=[], __version__="fake")

    @staticmethod
    def _check(q, k, v):
        assert q.dtype == k.dtype == v.dtype, "FA-2 needs one dtype"
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FA-2 needs one head dim"
        assert q.shape[-1] % 8 == 0, "FA-2 head dim must be a multiple of 8"

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1)):
        self._check(q, k, v)
        self.calls.append(("dense", causal, tuple(window_size), q.shape[2], k.shape[2]))
        mask = _flash_mask(q.shape[1], k.shape[1], causal, window_size)
        return torch.stack([_masked(q[b], k[b], v[b], mask, softmax_scale)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1)):
        self._check(q, k, v)
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        self.calls.append(("varlen", causal, tuple(window_size), q.shape[1], k.shape[1]))
        out = torch.zeros_like(q)
        bounds = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
        for a, b in zip(bounds, bounds[1:]):
            mask = _flash_mask(b - a, b - a, causal, window_size)
            out[a:b] = _masked(q[a:b], k[a:b], v[a:b], mask, softmax_scale)
        return out


def fake_torch_varlen(with_window=True, with_gqa=True):
    """torch.nn.attention.varlen.varlen_attn by its docs: window_size (-1, 0) is causal,
    (W, 0) keeps keys i-W..i. `with_window=False` mimics a torch whose varlen has only
    is_causal."""
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                    window_size=(-1, -1), enable_gqa=False, is_causal=False):
        if query.shape[1] != key.shape[1]:
            assert enable_gqa, "GQA without enable_gqa"
        calls.append(("varlen", tuple(window_size), is_causal, enable_gqa))
        out = torch.zeros_like(query)
        bounds = cu_seq_q.tolist()
        for a, b in zip(bounds, bounds[1:]):
            size = window_size if not is_causal else (-1, 0)
            mask = _flash_mask(b - a, b - a, False, size)
            out[a:b] = _masked(query[a:b], key[a:b], value[a:b], mask, scale)
        return out

    params = {"scale", "enable_gqa"} if with_gqa else {"scale"}
    params |= {"window_size"} if with_window else {"is_causal"}
    return (varlen_attn, frozenset(params)), calls


@pytest.fixture
def clean_env(monkeypatch):
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)
    monkeypatch.delenv("NSA_PROFILE", raising=False)
    return monkeypatch


@pytest.fixture
def fake_flash(clean_env):
    fake = FakeFlashAttn()
    clean_env.setattr(fa2, "_flash_attn", lambda: fake)
    clean_env.setattr(fa2, "_kernel_ineligible", lambda q, head_dim: None)
    return fake


@pytest.fixture
def fake_torch(clean_env):
    """torch kernels only: a fake varlen_attn with window support, SDPA flash as plain SDPA."""
    found, calls = fake_torch_varlen()
    clean_env.setattr(fa2, "_flash_attn", lambda: None)
    clean_env.setattr(fa2, "_torch_varlen", lambda: found)
    clean_env.setattr(fa2, "_kernel_ineligible", lambda q, head_dim: None)

    def sdpa_flash(q, k, v, scale):
        calls.append(("sdpa_flash",))
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        return torch.stack([_masked(q[b], k[b], v[b], mask, scale) for b in range(q.shape[0])])

    clean_env.setattr(fa2, "_torch_sdpa_flash", sdpa_flash)
    return calls


def _qkv(B, T, cfg=CFG, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H, G = cfg.n_heads, cfg.n_kv_heads
    q = torch.randn(B, T, H, cfg.d_k, generator=gen)
    k = torch.randn(B, T, G, cfg.d_k, generator=gen)
    v = torch.randn(B, T, G, cfg.d_v, generator=gen)
    return q, k, v


def _packed_cmp(k, v, cfg, bounds):
    """Mean-compressed k/v of each packed sequence, concatenated: [1, sum C_n, G, d]."""
    cfg = cfg.replace(compress="mean")
    ks = [reference.compress_kv(k[:, a:b], None, cfg) for a, b in zip(bounds, bounds[1:])]
    vs = [reference.compress_kv(v[:, a:b], None, cfg) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(ks, 1), torch.cat(vs, 1)


def bf_cmp(q, k_cmp, v_cmp, cfg):
    """bf_compressed_attention's output; tests/bruteforce.py fails on C = 0 (a max over an empty
    axis), where the spec's answer is all zeros."""
    if k_cmp.shape[1] == 0:
        return np.zeros((*q.shape[:3], v_cmp.shape[3]))
    return bf_compressed_attention(q, k_cmp, v_cmp, cfg)[0]


def _bf_window_packed(q, k, v, window, bounds):
    return np.concatenate([bf_sliding_window_attention(q[:, a:b], k[:, a:b], v[:, a:b], window)
                           for a, b in zip(bounds, bounds[1:]) if b > a], axis=1)


def _bf_cmp_packed(q, k_cmp, v_cmp, cfg, bounds):
    parts, offset = [], 0
    for a, b in zip(bounds, bounds[1:]):
        count = num_cmp_blocks(cfg, b - a)
        if b > a:
            parts.append(bf_cmp(q[:, a:b], k_cmp[:, offset:offset + count],
                                v_cmp[:, offset:offset + count], cfg))
        offset += count
    return np.concatenate(parts, axis=1)


# ---------------------------------------------------------------------------------------------
# Path selection without mocks
# ---------------------------------------------------------------------------------------------
def test_kernel_ineligible_reasons():
    cuda = torch.device("cuda")
    fake = types.SimpleNamespace
    assert "needs CUDA" in fa2._kernel_ineligible(torch.zeros(1), 16)
    assert "float16/bfloat16" in fa2._kernel_ineligible(fake(device=cuda, dtype=torch.float32), 16)
    assert "head dim 264" in fa2._kernel_ineligible(fake(device=cuda, dtype=torch.bfloat16), 264)
    assert fa2._kernel_ineligible(fake(device=cuda, dtype=torch.bfloat16), 256) is None


def test_cpu_falls_back_to_reference_exactly(clean_env):
    q, k, v = _qkv(2, 21)
    out = fa2.sliding_window_attention_fa2(q, k, v, 5)
    assert torch.equal(out, reference.sliding_window_attention(q, k, v, 5))
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, [0, 21])
    # _packed_cmp works on [1, ...] or [B, ...] alike: one sequence is the dense layout.
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG)
    assert torch.equal(out, reference.compressed_attention(q, k_cmp, v_cmp, CFG))


def test_force_varlen_and_dense_together_is_an_error(clean_env):
    clean_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    clean_env.setenv("NSA_FA2_FORCE_DENSE", "1")
    q, k, v = _qkv(1, 8)
    with pytest.raises(ValueError, match="NSA_FA2_FORCE_VARLEN.*NSA_FA2_FORCE_DENSE"):
        fa2.sliding_window_attention_fa2(q, k, v, 4)


@pytest.mark.parametrize("bad, match", [
    (dict(window=0), "window"),
    (dict(cu_seqlens=torch.tensor([0, 5, 4, 12])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 5, 11])), "cu_seqlens"),
])
def test_window_rejects_bad_arguments(clean_env, bad, match):
    q, k, v = _qkv(1, 12)
    args = dict(window=4, cu_seqlens=None) | bad
    with pytest.raises(ValueError, match=match):
        fa2.sliding_window_attention_fa2(q, k, v, args["window"], cu_seqlens=args["cu_seqlens"])


def test_compressed_rejects_wrong_block_count(clean_env):
    q, k, v = _qkv(1, 20)
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, [0, 20])
    with pytest.raises(ValueError, match="k_cmp holds"):
        fa2.compressed_attention_fa2(q, k_cmp[:, :-1], v_cmp[:, :-1], CFG)
    with pytest.raises(ValueError, match="k_cmp holds"):  # packed: blocks per sequence differ
        fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG, cu_seqlens=torch.tensor([0, 10, 20]))


# ---------------------------------------------------------------------------------------------
# flash_attn package (mocked)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 5, 64])
def test_flash_attn_window_dense(fake_flash, window):
    q, k, v = _qkv(2, 19)
    out = fa2.sliding_window_attention_fa2(q, k, v, window)
    assert rel_err(out, bf_sliding_window_attention(q, k, v, window)) < TOL
    assert fake_flash.calls == [("dense", True, (window - 1, 0), 4, 2)]


@pytest.mark.parametrize("force", [None, "NSA_FA2_FORCE_DENSE"])
def test_flash_attn_window_packed(fake_flash, force):
    bounds = [0, 7, 7, 20, 23]
    q, k, v = _qkv(1, 23)
    cu = torch.tensor(bounds, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as mp:
        if force:
            mp.setenv(force, "1")
        out = fa2.sliding_window_attention_fa2(q, k, v, 4, cu_seqlens=cu)
    assert rel_err(out, _bf_window_packed(q, k, v, 4, bounds)) < TOL
    kinds = {call[0] for call in fake_flash.calls}
    assert kinds == ({"dense"} if force else {"varlen"})
    if force:
        assert len(fake_flash.calls) == 3  # one dense call per non-empty sequence


def test_flash_attn_window_force_varlen_packs_the_batch(fake_flash, clean_env):
    clean_env.setenv("NSA_FA2_FORCE_VARLEN", "1")
    q, k, v = _qkv(3, 10)
    out = fa2.sliding_window_attention_fa2(q, k, v, 3)
    assert rel_err(out, bf_sliding_window_attention(q, k, v, 3)) < TOL
    assert fake_flash.calls == [("varlen", True, (2, 0), 4, 2)]


@pytest.mark.parametrize("T", [7, 8, 9, 23, 30])  # before, at and past the first block
def test_flash_attn_compressed_fold_dense(fake_flash, T):
    q, k, v = _qkv(2, T, seed=T)
    k_cmp = torch.randn(2, num_cmp_blocks(CFG, T), CFG.n_kv_heads, CFG.d_k)
    v_cmp = torch.randn(2, num_cmp_blocks(CFG, T), CFG.n_kv_heads, CFG.d_v)
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG)
    ref = bf_cmp(q, k_cmp, v_cmp, CFG)
    assert rel_err(out, ref) < TOL
    assert torch.all(out[:, :CFG.cmp_block - 1] == 0)  # no admissible block: exactly zero
    if T >= CFG.cmp_block:
        H, d = CFG.n_heads, CFG.cmp_stride
        # One square causal call over C blocks, H*d folded query heads against G KV heads.
        assert fake_flash.calls == [("dense", True, (-1, -1), H * d, CFG.n_kv_heads)]
    else:
        assert fake_flash.calls == []


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(cmp_block=4, cmp_stride=4, sel_block=4,
                                                   n_kv_heads=1, d_k=8, d_v=24)])
@pytest.mark.parametrize("force", [None, "NSA_FA2_FORCE_DENSE"])
def test_flash_attn_compressed_packed(fake_flash, cfg, force):
    bounds = [0, 5, 17, 17, 30]  # a sequence shorter than l, an empty one
    q, k, v = _qkv(1, 30, cfg=cfg, seed=3)
    k_cmp, v_cmp = _packed_cmp(k, v, cfg, bounds)
    with pytest.MonkeyPatch.context() as mp:
        if force:
            mp.setenv(force, "1")
        out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, cfg,
                                           cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    assert rel_err(out, _bf_cmp_packed(q, k_cmp, v_cmp, cfg, bounds)) < TOL
    assert {call[0] for call in fake_flash.calls} == ({"dense"} if force else {"varlen"})


def test_flash_attn_compressed_gradients_match_reference(fake_flash):
    q, k, v = _qkv(1, 22, seed=5)
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, [0, 22])
    leaves = [x.clone().requires_grad_() for x in (q, k_cmp, v_cmp)]
    leaves64 = [x.double().clone().requires_grad_() for x in (q, k_cmp, v_cmp)]
    out = fa2.compressed_attention_fa2(*leaves, CFG)
    ref = reference.compressed_attention(*leaves64, CFG)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for a, b in zip(leaves, leaves64):
        assert rel_err(a.grad, b.grad.numpy()) < 1e-4


def test_return_lse_uses_reference(fake_flash):
    q, k, v = _qkv(1, 20)
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, [0, 20])
    o, lse = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG, return_lse=True)
    o_ref, lse_ref = reference.compressed_attention(q, k_cmp, v_cmp, CFG, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert fake_flash.calls == []


# ---------------------------------------------------------------------------------------------
# torch's own kernels (mocked)
# ---------------------------------------------------------------------------------------------
def test_torch_window_goes_through_varlen_attn(fake_torch):
    q, k, v = _qkv(2, 15)
    out = fa2.sliding_window_attention_fa2(q, k, v, 6)
    assert rel_err(out, bf_sliding_window_attention(q, k, v, 6)) < TOL
    assert fake_torch == [("varlen", (5, 0), False, True)]  # the batch rows packed


def test_torch_window_covering_the_sequence_uses_sdpa_flash(fake_torch):
    q, k, v = _qkv(2, 15)
    out = fa2.sliding_window_attention_fa2(q, k, v, 15)
    assert rel_err(out, bf_sliding_window_attention(q, k, v, 15)) < TOL
    assert fake_torch == [("sdpa_flash",)]


def test_torch_compressed_dense_uses_sdpa_flash_and_packed_uses_varlen(fake_torch):
    q, k, v = _qkv(1, 26)
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, [0, 26])
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG)
    assert rel_err(out, bf_cmp(q, k_cmp, v_cmp, CFG)) < TOL
    assert fake_torch == [("sdpa_flash",)]
    fake_torch.clear()
    bounds = [0, 12, 26]
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, bounds)
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG,
                                       cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    assert rel_err(out, _bf_cmp_packed(q, k_cmp, v_cmp, CFG, bounds)) < TOL
    assert fake_torch == [("varlen", (-1, 0), False, True)]


def test_torch_without_varlen_window_falls_back_to_reference(clean_env):
    found, calls = fake_torch_varlen(with_window=False, with_gqa=False)
    clean_env.setattr(fa2, "_flash_attn", lambda: None)
    clean_env.setattr(fa2, "_torch_varlen", lambda: found)
    clean_env.setattr(fa2, "_kernel_ineligible", lambda q, head_dim: None)
    clean_env.setenv("NSA_DEBUG_LOG", "1")
    runtime.reset_log_counts()
    q, k, v = _qkv(1, 15)
    out = fa2.sliding_window_attention_fa2(q, k, v, 4)
    assert torch.equal(out, reference.sliding_window_attention(q, k, v, 4))
    assert calls == []
    # The compressed branch only needs causal: is_causal and GQA by repeated KV heads.
    bounds = [0, 9, 15]
    k_cmp, v_cmp = _packed_cmp(k, v, CFG, bounds)
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG,
                                       cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    assert rel_err(out, _bf_cmp_packed(q, k_cmp, v_cmp, CFG, bounds)) < TOL
    assert calls == [("varlen", (-1, -1), True, False)]


def test_fold_index_layout():
    index, valid, counts = fa2.fold_index(CFG, [(0, 14), (14, 3), (17, 8)], "cpu")
    # l = 8, d = 4: sequence 0 has blocks 0, 1 (rows 7..14 -> 7..13 valid), sequence 1 none,
    # sequence 2 one block (rows 17+7 .. 17+10 -> only 24 valid).
    assert counts == [2, 0, 1]
    assert index.tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 24, 25, 26, 27]
    assert valid.tolist() == [True] * 7 + [False] + [True] + [False] * 3


def test_mixed_dtypes_reach_the_kernel_as_one(fake_flash):
    # Under autocast the compressor's bias add leaves k_cmp/v_cmp float32 beside a bf16 q; here
    # float64 beside float32 plays that part (the fake kernel asserts a single dtype).
    q, k, v = _qkv(1, 22, seed=6)
    k_cmp, v_cmp = _packed_cmp(k.double(), v.double(), CFG, [0, 22])
    out = fa2.compressed_attention_fa2(q, k_cmp, v_cmp, CFG)
    assert out.dtype == q.dtype
    assert rel_err(out, bf_cmp(q, k_cmp, v_cmp, CFG)) < TOL
    out = fa2.sliding_window_attention_fa2(q, k.double(), v.double(), 5)
    assert out.dtype == q.dtype
    assert rel_err(out, bf_sliding_window_attention(q, k, v, 5)) < TOL
