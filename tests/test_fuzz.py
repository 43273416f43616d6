"""Fuzz (hypothesis) over random valid configurations: H, G, d_k != d_v, block sizes, n_sel,
n_init, n_local, window, compress mean / mlp, shared K/V, RoPE on / off, odd T and packing.

Each example compares the whole layer with the float64 brute force (`tests/bruteforce.py`):
nsa_jax on XLA (float64), on the Pallas kernels (interpret mode, float32, within the spec's
float32 tolerance), the torch reference (float64), and nsa_jax decode (prefill of a prefix, then
one `decode_step` per token) with the layer, and the torch fast paths (Triton selection, FA-2
window / compressed; on a CPU, Triton's interpreter and FA-2's torch fallback). Examples are
derandomized and few, so CI time stays bounded (each new configuration compiles anew) and a
failure reproduces.

The Triton interpreter has to be switched on before triton is first imported: set here, at
collection, as in test_torch_triton_selection.py.
"""
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import nsa_jax
from bruteforce import bf_nsa_layer
from conftest import enable_x64
from jax_inputs import make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig

TOL_F64 = 1e-9    # float64 against the float64 brute force
TOL_F32 = 1e-5    # the spec's float32 output tolerance

# No shrinking: each shrink step compiles a new configuration (minutes on CI); the failing
# example is printed as drawn, and derandomize makes it come back on every run.
FUZZ = settings(derandomize=True, deadline=None, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layer_cases(draw, packing: bool = True):
    """-> (cfg, B, T, cu_seqlens or None)."""
    G = draw(st.sampled_from([1, 2]))
    rope = draw(st.booleans())
    d_k = draw(st.sampled_from([4, 8]) if rope else st.sampled_from([3, 4, 8]))
    stride = draw(st.sampled_from([1, 2, 4]))
    cmp_block = stride * draw(st.sampled_from([1, 2]))
    n_init, n_local = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    cfg = NSAConfig(
        d_model=draw(st.sampled_from([8, 12])), n_heads=G * draw(st.sampled_from([1, 2])),
        n_kv_heads=G, d_k=d_k, d_v=draw(st.sampled_from([2, 4, 6])), cmp_block=cmp_block,
        cmp_stride=stride, sel_block=cmp_block * draw(st.sampled_from([1, 2])),
        n_sel=max(1, n_init + n_local + draw(st.integers(0, 2))), n_init=n_init,
        n_local=n_local, window=draw(st.integers(1, 12)),
        compress=draw(st.sampled_from(["mean", "mlp"])), shared_kv=draw(st.booleans()),
        rope_theta=10000.0 if rope else None)
    T = draw(st.integers(1, 29))
    if packing and T >= 2 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, T - 1), min_size=1, max_size=2)))
        return cfg, 1, T, [0, *cuts, T]
    return cfg, draw(st.integers(1, 2)), T, None


def _reference(params, x, cfg, cu_seqlens):
    tree = jax.tree_util.tree_map(np.asarray, params)
    return bf_nsa_layer(tree, np.asarray(x), cfg, cu_seqlens=cu_seqlens)


@settings(FUZZ, max_examples=6)
@given(case=layer_cases())
def test_xla_layer_matches_bruteforce(case):
    cfg, B, T, cu = case
    with enable_x64():
        params, x = make_inputs(cfg, B, T, jnp.float64)
        y, aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True,
                                       cu_seqlens=None if cu is None else jnp.array(cu, jnp.int32))
        ref_y, ref_aux = _reference(params, x, cfg, cu)
        assert rel_err(y, ref_y) <= TOL_F64
        np.testing.assert_array_equal(aux["block_idx"], ref_aux["block_idx"])


@settings(FUZZ, max_examples=2)
@given(case=layer_cases(packing=False))
def test_pallas_layer_matches_bruteforce(case):
    cfg, B, T, _ = case
    params, x = make_inputs(cfg, B, T, jnp.float32)
    y, aux = nsa_jax.nsa_attention(params, x, cfg, backend=("pallas", "xla"), return_aux=True)
    ref_y, ref_aux = _reference(params, x, cfg, None)
    assert rel_err(y, ref_y) <= TOL_F32
    np.testing.assert_array_equal(aux["block_idx"], ref_aux["block_idx"])


@settings(FUZZ, max_examples=8)
@given(case=layer_cases())
def test_torch_reference_layer_matches_bruteforce(case):
    _check_torch_layer(case, backends=None, dtype=torch.float64, tol=TOL_F64)


@settings(FUZZ, max_examples=2)
@given(case=layer_cases())
def test_torch_fast_paths_match_bruteforce(case):
    """float32: the Triton kernels take float32 / bf16 / fp16 only."""
    from nsa_torch_ref.fast import routing, triton_selection

    if not torch.cuda.is_available() and not triton_selection._interpreted():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and TRITON_INTERPRET is not 1")
        importlib.reload(triton_selection)  # imported earlier without the interpreter
    routing.register_fast_paths()
    backends = {"selected_attention": "triton", "compressed_attention": "fa2",
                "sliding_window_attention": "fa2"}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernels need CUDA
    _check_torch_layer(case, backends=backends, dtype=torch.float32, tol=TOL_F32, device=device)


def _check_torch_layer(case, *, backends, dtype, tol, device="cpu"):
    from nsa_torch_ref import NSAAttention
    from parity.convert import params_to_module

    cfg, B, T, cu = case
    with enable_x64():
        params, x = make_inputs(cfg, B, T, jnp.float64)
        ref_y, ref_aux = _reference(params, x, cfg, cu)
        module = params_to_module(params, NSAAttention(cfg, backends=backends, dtype=dtype,
                                                       device=device))
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    with torch.no_grad():
        y, aux = module(torch.from_numpy(np.array(x)).to(device, dtype), return_aux=True,
                        cu_seqlens=cu_seqlens)
    assert rel_err(y.cpu().numpy(), ref_y) <= tol
    np.testing.assert_array_equal(aux["block_idx"].cpu().numpy(), ref_aux["block_idx"])


@settings(FUZZ, max_examples=3)
@given(case=layer_cases(packing=False), prefix_frac=st.floats(0.0, 1.0))
def test_decode_matches_layer(case, prefix_frac):
    """prefill(x[:, :P]) then decode_step for every later token == the layer over all of x."""
    cfg, B, T, _ = case
    P = max(1, int(prefix_frac * T))
    with enable_x64():
        params, x = make_inputs(cfg, B, T, jnp.float64)
        y = nsa_jax.nsa_attention(params, x, cfg)
        cache = nsa_jax.init_cache(cfg, B, T, jnp.float64)
        y_pre, cache = nsa_jax.prefill(params, x[:, :P], cfg, cache)
        steps = [y_pre]
        for t in range(P, T):
            y_t, cache, _ = nsa_jax.decode_step(params, x[:, t:t + 1], cfg, cache)
            steps.append(y_t)
        assert rel_err(jnp.concatenate(steps, axis=1), y) <= TOL_F64
