"""Compressed-attention Pallas kernels (interpret mode on CPU) against the plain-jnp reference
and the float64 brute force: outputs, lse, gradients, and the spec's edge cases."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bruteforce as bf
from conftest import jax_has_gpu
from nsa_common import NSAConfig
from nsa_common.testing import rel_err
from pallas_kernels.compressed_attention import (
    FLOAT32_BLOCK_SIZES,
    BlockSizes,
    compressed_attention,
    compressed_attention_reference,
)

# Relative L2 error bounds (docs/NSA_SPEC.md "Tolerances").
TOL = {jnp.float32: {"out": 1e-5, "grad": 1e-4}, jnp.bfloat16: {"out": 1e-2, "grad": 1e-2}}

# Small tiles so that the tiny CPU shapes still span several query and key tiles, and the dK/dV
# kernel splits each key tile's queries into a few parts (the default tiles split them fully).
SMALL = BlockSizes(block_q=16, block_kv=16, block_q_dq=16, block_kv_dq=16, block_q_dkv=32,
                   block_kv_dkv=16, dkv_programs=4)


def make_inputs(seed, B, T, H, G, d_k, d_v, l, d, dtype=jnp.float32):
    """Random q, k_cmp, v_cmp (NumPy's generator: no per-shape compile) and output cotangents."""
    C = max(0, (T - l) // d + 1)
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = (jnp.asarray(normal(*shape), dtype) for shape in
               ((B, T, H, d_k), (B, C, G, d_k), (B, C, G, d_v)))
    return q, k, v, jnp.asarray(normal(B, T, H, d_v)), jnp.asarray(normal(B, T, H))


def outputs_and_grads(attention, q, k, v, do, dlse, **kw):
    """(o, lse, (dq, dk, dv)) in one jitted call, with a loss that pulls on both outputs so that
    the lse cotangent path is checked too."""
    def loss(q, k, v):
        o, lse = attention(q, k, v, **kw)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(finite_lse * dlse), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return o, lse, grads


# (B, T, H, G, d_k, d_v, l, d): h = 4, 1, 16, 3; T not a multiple of d, of l, or of the tiles;
# d_k != d_v and head dims that are not powers of two.
CASES = [
    (1, 50, 4, 1, 16, 8, 8, 4),
    (2, 37, 2, 2, 24, 40, 8, 4),
    (1, 45, 16, 1, 16, 16, 16, 8),
    (1, 29, 6, 2, 8, 12, 4, 4),
]


@pytest.mark.parametrize("case, dkv_transposed",
                         [(CASES[1], True), (CASES[1], False)]
                         + [pytest.param(c, True, marks=pytest.mark.slow)
                            for c in CASES if c != CASES[1]],
                         ids=lambda c: ("B{}T{}H{}G{}dk{}dv{}l{}d{}".format(*c)
                                        if isinstance(c, tuple) else f"transposed={c}"))
def test_forward_and_gradients_float32(case, dkv_transposed):
    B, T, H, G, d_k, d_v, l, d = case
    q, k, v, do, dlse = make_inputs(0, *case)
    kw = dict(cmp_block=l, cmp_stride=d)
    tiles = dataclasses.replace(SMALL, dkv_transposed=dkv_transposed)
    o, lse, grad = outputs_and_grads(compressed_attention, q, k, v, do, dlse,
                                     block_sizes=tiles, interpret=True, **kw)
    o_ref, lse_ref, grad_ref = outputs_and_grads(compressed_attention_reference, q, k, v, do,
                                                 dlse, **kw)
    assert o.shape == (B, T, H, d_v) and o.dtype == q.dtype
    assert lse.shape == (B, T, H) and lse.dtype == jnp.float32
    assert rel_err(o, o_ref) <= TOL[jnp.float32]["out"]
    # lse is -inf exactly where the query sees no block (t < l - 1), finite elsewhere.
    empty = np.arange(T) < l - 1
    np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(empty[None, :, None],
                                                                     lse.shape))
    assert rel_err(np.where(np.isfinite(lse), lse, 0), np.where(np.isfinite(lse_ref), lse_ref, 0)
                   ) <= TOL[jnp.float32]["out"]
    assert np.all(np.asarray(o)[:, empty] == 0.0)

    cfg = NSAConfig(n_heads=H, n_kv_heads=G, d_k=d_k, d_v=d_v, cmp_block=l, cmp_stride=d,
                    sel_block=max(l, 2 * d), n_sel=3, rope_theta=None)
    o_bf, _ = bf.bf_compressed_attention(np.asarray(q), np.asarray(k), np.asarray(v), cfg)
    assert rel_err(o, o_bf) <= TOL[jnp.float32]["out"]

    for name, g, g_ref in zip(("dq", "dk", "dv"), grad, grad_ref):
        assert g.shape == g_ref.shape and g.dtype == g_ref.dtype, name
        assert rel_err(g, g_ref) <= TOL[jnp.float32]["grad"], name
    # Queries that see no block get exactly zero gradient.
    assert np.all(np.asarray(grad[0])[:, empty] == 0.0)


@pytest.mark.parametrize("dkv_transposed", [True, False])
def test_split_head_dim_matches_reference_and_padded(dkv_transposed):
    """d_k 192 = 128 + 64 enters the products as two column parts (q read at 192 columns, not
    padded to 256): same outputs and gradients as the reference, and as the padded tiles."""
    case = (1, 37, 4, 2, 192, 40, 8, 4)
    q, k, v, do, dlse = make_inputs(5, *case)
    kw = dict(cmp_block=8, cmp_stride=4, interpret=True)
    split = dataclasses.replace(SMALL, dkv_transposed=dkv_transposed)
    padded = dataclasses.replace(split, split_dk=False)
    o, lse, grad = outputs_and_grads(compressed_attention, q, k, v, do, dlse, block_sizes=split,
                                     **kw)
    o_pad, lse_pad, grad_pad = outputs_and_grads(compressed_attention, q, k, v, do, dlse,
                                                 block_sizes=padded, **kw)
    o_ref, _, grad_ref = outputs_and_grads(compressed_attention_reference, q, k, v, do, dlse,
                                           cmp_block=8, cmp_stride=4)
    assert rel_err(o, o_ref) <= TOL[jnp.float32]["out"]
    assert rel_err(o, o_pad) <= 1e-6
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_pad), rtol=1e-5, atol=1e-6)
    for name, g, g_pad, g_ref in zip(("dq", "dk", "dv"), grad, grad_pad, grad_ref):
        assert g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) <= TOL[jnp.float32]["grad"], name
        assert rel_err(g, g_pad) <= 1e-5, name


def test_bfloat16_default_tiles_and_custom_scale():
    case = (1, 40, 8, 2, 32, 16, 8, 4)
    B, T, H, G, d_k, d_v, l, d = case
    q, k, v, do, dlse = make_inputs(1, *case, dtype=jnp.bfloat16)
    kw = dict(cmp_block=l, cmp_stride=d, scale=0.3)
    o, lse, grad = outputs_and_grads(compressed_attention, q, k, v, do, dlse, interpret=True,
                                     **kw)
    # The reference in float32 from the same bf16 inputs.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref, lse_ref, grad_ref = outputs_and_grads(compressed_attention_reference, *f32, do, dlse,
                                                 **kw)
    assert o.dtype == jnp.bfloat16
    assert rel_err(o, o_ref) <= TOL[jnp.bfloat16]["out"]
    finite = np.isfinite(np.asarray(lse_ref))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert rel_err(np.asarray(lse)[finite], np.asarray(lse_ref)[finite]) <= TOL[jnp.bfloat16]["out"]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grad, grad_ref):
        assert g.dtype == jnp.bfloat16, name
        assert rel_err(g, g_ref) <= TOL[jnp.bfloat16]["grad"], name


def test_no_compressed_block_yet():
    """T < l: C = 0, no kernel launch; o = 0, lse = -inf, gradients zero and finite."""
    q, k, v, do, dlse = make_inputs(2, 1, 6, 4, 2, 16, 8, 8, 4)
    assert k.shape[1] == 0
    o, lse, (dq, dk, dv) = outputs_and_grads(compressed_attention, q, k, v, do, dlse,
                                             cmp_block=8, cmp_stride=4, interpret=True)
    assert o.shape == (1, 6, 4, 8) and np.all(np.asarray(o) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))
    assert np.all(np.asarray(dq) == 0.0) and dk.shape == k.shape and dv.shape == v.shape


def test_bad_inputs_raise_value_error():
    q, k, v, _, _ = make_inputs(3, 1, 20, 4, 2, 16, 8, 8, 4)
    with pytest.raises(ValueError, match="cmp_stride"):
        compressed_attention(q, k, v, cmp_block=8, cmp_stride=0, interpret=True)
    with pytest.raises(ValueError, match="multiple of the heads"):
        compressed_attention(q[:, :, :3], k, v, cmp_block=8, cmp_stride=4, interpret=True)
    with pytest.raises(ValueError, match="v_cmp"):
        compressed_attention(q, k, v[:, :2], cmp_block=8, cmp_stride=4, interpret=True)
    with pytest.raises(ValueError, match="k_cmp"):
        compressed_attention(q, k[..., :8], v, cmp_block=8, cmp_stride=4, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=24)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [
    (1, 1000, 16, 4, 64, 32, 32, 16),
    (1, 2048, 64, 4, 128, 128, 32, 16),   # paper sizes: float32 tiles must fit shared memory
    (2, 80, 4, 2, 16, 8, 8, 4),           # the parity report's tiny preset
    (1, 1000, 16, 4, 192, 128, 32, 16),   # the paper's d_k: two column parts (128 + 64)
])
@pytest.mark.parametrize("dkv_transposed", [True, False])
def test_gpu_matches_reference(dtype, case, dkv_transposed):
    B, T, H, G, d_k, d_v, l, d = case
    q, k, v, do, dlse = make_inputs(4, *case, dtype=dtype)
    kw = dict(cmp_block=l, cmp_stride=d)
    tiles = None
    if not dkv_transposed:
        tiles = FLOAT32_BLOCK_SIZES if dtype == jnp.float32 else BlockSizes()
        tiles = dataclasses.replace(tiles, dkv_transposed=False)
    o, lse, grad = outputs_and_grads(compressed_attention, q, k, v, do, dlse, block_sizes=tiles,
                                     **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref, lse_ref, grad_ref = outputs_and_grads(compressed_attention_reference, *f32, do, dlse,
                                                 **kw)
    assert rel_err(o, o_ref) <= TOL[dtype]["out"]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grad, grad_ref):
        assert rel_err(g, g_ref) <= TOL[dtype]["grad"], name
