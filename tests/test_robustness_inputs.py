"""No deep crashes (docs/ROBUSTNESS.md): empty batches, empty sequences, wrong dtypes and traced
`cu_seqlens` are handled or refused by name, in both frameworks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import checkify

import nsa_jax
from jax_inputs import make_inputs
from nsa_common import NSAConfig
from nsa_torch_ref import NSAAttention

CFG = NSAConfig.tiny(n_sel=3)
T = 20


def test_jax_empty_batch_gives_empty_results_and_zero_gradients():
    params, _ = make_inputs(CFG, 1, 1, jnp.float32)
    x = jnp.zeros((0, T, CFG.d_model))
    y, aux = nsa_jax.nsa_attention(params, x, CFG, return_aux=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert aux["o_sel"].shape == (0, T, CFG.n_heads, CFG.d_v)
    assert aux["block_idx"].shape == (0, T, CFG.n_kv_heads, CFG.n_sel)
    grads = jax.grad(lambda p: jnp.sum(nsa_jax.nsa_attention(p, x, CFG)))(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree_util.tree_leaves(grads))


def test_jax_empty_batch_on_pallas():
    params, _ = make_inputs(CFG, 1, 1, jnp.float32)
    y = nsa_jax.nsa_attention(params, jnp.zeros((0, T, CFG.d_model)), CFG,
                              backend=("pallas", "xla"))
    assert y.shape == (0, T, CFG.d_model)


@pytest.mark.parametrize("B", [0, 2])
def test_empty_sequence_is_refused_by_name(B):
    params, _ = make_inputs(CFG, 1, 1, jnp.float32)
    with pytest.raises(ValueError, match=r"T = 0"):
        nsa_jax.nsa_attention(params, jnp.zeros((B, 0, CFG.d_model)), CFG)
    with pytest.raises(ValueError, match=r"T >= 1"):
        NSAAttention(CFG)(torch.zeros(B, 0, CFG.d_model))


def test_torch_empty_batch_gives_empty_results_and_zero_gradients():
    layer = NSAAttention(CFG)
    x = torch.zeros(0, T, CFG.d_model, requires_grad=True)
    y, aux = layer(x, return_aux=True)
    assert y.shape == x.shape and aux["o_cmp"].shape == (0, T, CFG.n_heads, CFG.d_v)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(not p.grad.any() for p in layer.parameters())


def test_torch_layer_refuses_wrong_dtypes_by_name():
    layer = NSAAttention(CFG)
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor, got torch.int64"):
        layer(torch.zeros(1, T, CFG.d_model, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x has dtype torch.float64 .* torch.float32"):
        layer(torch.zeros(1, T, CFG.d_model, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes are autocast's normal case
        assert layer(torch.randn(1, T, CFG.d_model, dtype=torch.bfloat16)).shape[1] == T


def test_traced_cu_seqlens_are_checked_under_checkify():
    params, x = make_inputs(CFG, 1, 40, jnp.float32)

    @jax.jit
    def step(x, cu):
        nsa_jax.check_cu_seqlens(cu, x.shape[1])
        return nsa_jax.nsa_attention(params, x, CFG, cu_seqlens=cu)

    checked = checkify.checkify(step)
    err, y = checked(x, jnp.array([0, 30, 40], jnp.int32))
    err.throw()  # valid: no error
    assert y.shape == x.shape
    for bad in ([0, 30, 20, 40], [0, 30, 39], [1, 30, 40]):
        err, _ = checked(x, jnp.array(bad, jnp.int32))
        with pytest.raises(checkify.JaxRuntimeError, match="cu_seqlens must rise from 0 to T"):
            err.throw()
    # The same predicate in plain jnp, for callers that branch instead of raising.
    valid = jax.jit(nsa_jax.cu_seqlens_valid, static_argnums=1)
    assert bool(valid(jnp.array([0, 30, 40]), 40))
    assert not bool(valid(jnp.array([0, 30, 20, 40]), 40))


def test_check_cu_seqlens_on_concrete_values_and_without_checkify():
    with pytest.raises(ValueError, match=r"cu_seqlens \(\[0, 30, 20, 40\]\) must rise"):
        nsa_jax.check_cu_seqlens(jnp.array([0, 30, 20, 40], jnp.int32), 40)
    nsa_jax.check_cu_seqlens(np.array([0, 0, 40], np.int32), 40)  # an empty sequence is fine
    with pytest.raises(ValueError, match="cu_seqlens must be an integer array"):
        nsa_jax.check_cu_seqlens(jnp.array([0.0, 40.0]), 40)
    # Traced without checkify: refused at trace time rather than silently unchecked.
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(lambda cu: nsa_jax.check_cu_seqlens(cu, 40))(jnp.array([0, 40], jnp.int32))


def test_pallas_selected_attention_empty_batch():
    from pallas_kernels.selected_attention import selected_attention
    q, k, v = jnp.zeros((0, T, 2, 16)), jnp.zeros((0, T, 1, 16)), jnp.zeros((0, T, 1, 8))
    block_idx = jnp.zeros((0, T, 1, 2), jnp.int32)
    out, grads = jax.value_and_grad(
        lambda q: jnp.sum(selected_attention(q, k, v, block_idx, 16, interpret=True)))(q)
    assert out == 0 and grads.shape == q.shape
    assert selected_attention(q, k, v, block_idx, 16, interpret=True).shape == (0, T, 2, 8)
