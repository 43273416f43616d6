"""Triton selected attention (nsa_torch_ref/fast/triton_selection.py), forward and backward.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 has to be in the
environment when `@triton.jit` decorates them (Triton 3.9 reads it then), so it is set here
before `nsa_torch_ref.fast.triton_selection` is imported, and the module is reloaded if an earlier
import built GPU kernels. With CUDA the same tests run the compiled kernels on the GPU.

Reference: a float64 gather implementation written here (autograd gives its gradients), and
tests/bruteforce.py (NumPy float64) for the forward. Shapes are tiny: the interpreter runs every
program in Python.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from bruteforce import bf_selected_attention  # noqa: E402
from nsa_common import NSAConfig  # noqa: E402
from nsa_common.testing import rel_err  # noqa: E402
from nsa_torch_ref import reference  # noqa: E402
from nsa_torch_ref.fast import triton_selection as ts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not ts._interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)
    ts = importlib.reload(ts)  # imported earlier without the interpreter

TOL_F32 = 1e-5      # float32 outputs against float64 (relative error)
TOL_F32_GRAD = 1e-4
TOL_16 = 1e-2       # bfloat16 / float16 outputs and gradients


def gather_reference(q, k, v, block_idx, block_size, scale=None):
    """Selected attention by gathering each (t, g)'s listed blocks, in q's dtype (float64 here)."""
    B, T, H, d_k = q.shape
    G = k.shape[2]
    scale = d_k ** -0.5 if scale is None else scale
    idx = block_idx.long()
    token = idx[..., None] * block_size + torch.arange(block_size, device=q.device)
    t = torch.arange(T, device=q.device)[None, :, None, None, None]
    valid = ((idx[..., None] >= 0) & (token <= t)).flatten(3)  # [B, T, G, n*bs]
    token = token.clamp(0, T - 1).flatten(3)
    b = torch.arange(B, device=q.device)[:, None, None, None]
    g = torch.arange(G, device=q.device)[None, None, :, None]
    k_sel, v_sel = k[b, token, g], v[b, token, g]  # [B, T, G, n*bs, d]
    qg = q.reshape(B, T, G, H // G, d_k)
    scores = torch.einsum("btghd,btgsd->btghs", qg, k_sel) * scale
    scores = scores.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key give 0
    return torch.einsum("btghs,btgsd->btghd", probs, v_sel).reshape(B, T, H, -1)


def random_block_idx(B, T, G, n_sel, block_size, seed, starts=None):
    """Ascending distinct eligible blocks per (t, g), -1 padded; `starts` [T] are the first
    tokens of each token's packed sequence (local block numbers)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((B, T, G, n_sel), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            local = t - (0 if starts is None else starts[t])
            for g in range(G):
                eligible = local // block_size + 1
                count = int(torch.randint(1, min(n_sel, eligible) + 1, (1,), generator=gen))
                chosen = torch.randperm(eligible, generator=gen)[:count].sort().values
                idx[b, t, g, :count] = chosen.int()
    return idx


def make_inputs(B, T, H, G, d_k, d_v, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, d_k, generator=gen, dtype=torch.float64),
            torch.randn(B, T, G, d_k, generator=gen, dtype=torch.float64),
            torch.randn(B, T, G, d_v, generator=gen, dtype=torch.float64))


def run_both(q, k, v, idx, block_size, dtype, scale=None, cu_seqlens=None, ref_fn=None):
    """(triton o, grads) and (float64 reference o, grads) for one random upstream gradient."""
    leaves = [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    out = ts.selected_attention_triton(*leaves, idx.to(DEVICE), block_size, scale,
                                       cu_seqlens=None if cu_seqlens is None
                                       else cu_seqlens.to(DEVICE))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(DEVICE, dtype))
    on_cpu = [x.cpu() for x in leaves64]
    ref = ref_fn(on_cpu) if ref_fn else gather_reference(*on_cpu, idx, block_size, scale)
    ref.backward(grad)
    return (out, [x.grad for x in leaves]), (ref, [x.grad for x in leaves64])


CASES = [  # (B, T, H, G, d_k, d_v, block_size, n_sel)
    pytest.param(1, 13, 2, 2, 16, 16, 4, 2, id="h1"),
    pytest.param(1, 12, 3, 1, 12, 20, 5, 3, id="h3-dk12-dv20-bs5"),
    pytest.param(2, 9, 2, 1, 8, 8, 3, 2, id="batch2-bs3"),
]


def assert_float32_close(out, grads, ref, ref_grads):
    """o within TOL_F32 of the float64 reference and dq, dk, dv within TOL_F32_GRAD."""
    assert rel_err(out, ref) < TOL_F32
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        assert rel_err(grad, ref_grad) < TOL_F32_GRAD, name


@pytest.mark.parametrize("B, T, H, G, d_k, d_v, block_size, n_sel", CASES)
def test_float32_forward_and_backward(B, T, H, G, d_k, d_v, block_size, n_sel):
    q, k, v = make_inputs(B, T, H, G, d_k, d_v, seed=T)
    idx = random_block_idx(B, T, G, n_sel, block_size, seed=T)
    (out, grads), (ref, ref_grads) = run_both(q, k, v, idx, block_size, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (B, T, H, d_v)
    assert_float32_close(out, grads, ref, ref_grads)


def test_many_heads_per_group_and_custom_scale():
    q, k, v = make_inputs(1, 6, 32, 1, 8, 8, seed=2)
    idx = random_block_idx(1, 6, 1, 2, 2, seed=2)
    (out, grads), (ref, ref_grads) = run_both(q, k, v, idx, 2, torch.float32, scale=0.3)
    assert_float32_close(out, grads, ref, ref_grads)


def test_block_larger_than_one_key_tile():
    # block_size 66 > block_n 64: each block is walked in two key tiles.
    q, k, v = make_inputs(1, 68, 2, 1, 8, 8, seed=4)
    idx = random_block_idx(1, 68, 1, 2, 66, seed=4)
    assert ts.SelectionBlockSizes.for_dims(66, 8, 8).block_n < 66
    (out, grads), (ref, ref_grads) = run_both(q, k, v, idx, 66, torch.float32)
    assert_float32_close(out, grads, ref, ref_grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = make_inputs(1, 12, 4, 2, 16, 8, seed=7)
    idx = random_block_idx(1, 12, 2, 2, 4, seed=7)
    (out, grads), (ref, ref_grads) = run_both(q, k, v, idx, 4, dtype)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL_16
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.dtype == dtype
        assert rel_err(grad, ref_grad) < TOL_16


def test_key_value_dtype_follows_q():
    # Autocast can hand over k, v in another dtype than q: they are cast to q's, and their
    # gradients come back in their own dtype.
    q, k, v = make_inputs(1, 6, 2, 1, 8, 8, seed=21)
    idx = random_block_idx(1, 6, 1, 2, 2, seed=21)
    q32 = q.float().to(DEVICE).requires_grad_()
    k64, v64 = (x.to(DEVICE).requires_grad_() for x in (k, v))
    out = ts.selected_attention_triton(q32, k64, v64, idx.to(DEVICE), 2)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert k64.grad.dtype == torch.float64 and v64.grad.dtype == torch.float64
    assert rel_err(out, gather_reference(q, k, v, idx, 2)) < TOL_F32


def test_forward_matches_bruteforce_float64():
    q, k, v = make_inputs(2, 11, 4, 2, 16, 8, seed=9)
    idx = random_block_idx(2, 11, 2, 3, 3, seed=9)
    out = ts.selected_attention_triton(*(x.to(DEVICE, torch.float32) for x in (q, k, v)),
                                       idx.to(DEVICE), 3)
    assert rel_err(out, bf_selected_attention(q.numpy(), k.numpy(), v.numpy(), idx.numpy(), 3)) \
        < TOL_F32


def test_block_idx_from_select_blocks_matches_reference():
    cfg = NSAConfig.tiny(compress="mean")  # l 8, d 4, l_sel 16, n_sel 4
    T = 34
    q, k, v = make_inputs(1, T, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, seed=11)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    idx = reference.select_blocks(q32, reference.compress_kv(k32, None, cfg), cfg)
    assert (idx == -1).any() and (idx >= 0).any()  # padding and real blocks both present
    out = ts.selected_attention_triton(q32.to(DEVICE), k32.to(DEVICE), v32.to(DEVICE),
                                       idx.to(DEVICE), cfg.sel_block)
    ref = reference.selected_attention(q, k, v, idx, cfg.sel_block)
    assert rel_err(out, ref) < TOL_F32


def test_padding_rows_output_zero_with_finite_gradients():
    q, k, v = make_inputs(1, 8, 2, 1, 8, 8, seed=5)
    idx = random_block_idx(1, 8, 1, 2, 4, seed=5)
    idx[0, 3] = -1  # no block at all: the spec never produces it, the kernel must still cope
    leaves = [x.to(DEVICE, torch.float32).requires_grad_() for x in (q, k, v)]
    out, lse = ts.selected_attention_triton_with_lse(*[x.detach() for x in leaves],
                                                     idx.to(DEVICE), 4)
    assert torch.all(out[0, 3] == 0) and torch.all(lse[0, 3] == float("-inf"))
    assert torch.isfinite(lse[0, :3]).all()
    out = ts.selected_attention_triton(*leaves, idx.to(DEVICE), 4)
    out.sum().backward()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert torch.all(leaves[0].grad[0, 3] == 0)
    ref = gather_reference(q, k, v, idx, 4)
    assert rel_err(out, ref) < TOL_F32


def test_packed_sequences_match_separate_calls():
    bounds = [0, 5, 14, 17]
    T = bounds[-1]
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1]), torch.diff(torch.tensor(bounds)))
    q, k, v = make_inputs(1, T, 2, 1, 8, 16, seed=13)
    idx = random_block_idx(1, T, 1, 2, 3, seed=13, starts=starts.tolist())

    def packed_reference(leaves):
        q64, k64, v64 = leaves
        return torch.cat([gather_reference(q64[:, a:b], k64[:, a:b], v64[:, a:b], idx[:, a:b], 3)
                          for a, b in zip(bounds, bounds[1:])], dim=1)

    (out, grads), (ref, ref_grads) = run_both(
        q, k, v, idx, 3, torch.float32, cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        ref_fn=packed_reference)
    assert_float32_close(out, grads, ref, ref_grads)


def test_backward_is_deterministic():
    q, k, v = make_inputs(1, 8, 4, 2, 8, 8, seed=17)
    idx = random_block_idx(1, 8, 2, 3, 2, seed=17)
    grads = []
    for _ in range(2):
        leaves = [x.to(DEVICE, torch.float32).requires_grad_() for x in (q, k, v)]
        ts.selected_attention_triton(*leaves, idx.to(DEVICE), 2).square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for first, second in zip(*grads):
        assert torch.equal(first, second)


def test_inverse_index_lists_the_selecting_queries():
    idx = random_block_idx(2, 10, 2, 3, 3, seed=19)
    idx[0, 9, 1, -1] = 3  # a listed block past t = 9's own block: no key <= t, so dropped
    n_blocks = 4
    ptr, queries = ts.inverse_index(idx, 3, n_blocks, None, None, None)
    for b in range(2):
        for g in range(2):
            for j in range(n_blocks):
                expected = [t for t in range(10)
                            if j in idx[b, t, g].tolist() and j * 3 <= t]
                lo, hi = ptr[(b * 2 + g) * n_blocks + j], ptr[(b * 2 + g) * n_blocks + j + 1]
                assert queries[lo:hi].tolist() == expected


@pytest.mark.parametrize("change, match", [
    (dict(block_size=0), "block_size"),
    (dict(idx_dtype=torch.float32), "integer"),
    (dict(idx_shape=(1, 7, 2, 2)), "block_idx"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(k_heads=3), "multiple"),
    (dict(cu_seqlens=torch.tensor([0, 3, 9])), "cu_seqlens"),
])
def test_bad_arguments_raise_value_error(change, match):
    H, G = 4, change.get("k_heads", 2)
    dtype = change.get("dtype", torch.float32)
    q = torch.randn(1, 8, H, 8, dtype=dtype, device=DEVICE)
    k = torch.randn(1, 8, G, 8, dtype=dtype, device=DEVICE)
    v = torch.randn(1, 8, G, 8, dtype=dtype, device=DEVICE)
    shape = change.get("idx_shape", (1, 8, G, 2))
    idx = torch.zeros(shape, dtype=change.get("idx_dtype", torch.int32), device=DEVICE)
    with pytest.raises(ValueError, match=match):
        ts.selected_attention_triton(q, k, v, idx, change.get("block_size", 4),
                                     cu_seqlens=change.get("cu_seqlens"))
