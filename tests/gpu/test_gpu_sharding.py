"""GPU, several devices: the sharded layer (`nsa_jax.sharding`, collectives through
NCCL) against the same layer on one GPU: forward, aux and the gradients of every parameter and
of x, float32 and bfloat16, on every mesh the visible GPUs allow (each axis alone from 2 GPUs,
two axes combined from 4, all three from 8), XLA and Pallas paths, plus prefill + decode.

The fake-device CPU version of these checks (float64, tight tolerances) is
`tests/test_sharding_mesh.py`; this one is what only real devices show (NCCL all-gathers,
ppermutes and psums, the compiled kernels inside `shard_map`). It skips without 2 GPUs.

float32 runs at "highest" matmul precision (conftest), so sharded and unsharded differ only in
the order of a few sums: held to the GPU matrix's float32 tolerances. bfloat16 rounds each
shard's products on its own, so a near-tie in the block ranking can flip: there the sharded
layer is held to be no less accurate than the one-GPU layer against the float32 result of the
same parameters and inputs, and to agree with it within the bfloat16 tolerance.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import nsa_jax
from conftest import jax_has_gpu
from jax_inputs import make_inputs
from nsa_common import NSAConfig
from nsa_common.testing import rel_err
from nsa_jax import sharding
from sharding_helpers import grad_errors, loss_and_grads, make_mesh


def _gpu_count() -> int:
    return len(jax.devices("gpu")) if jax_has_gpu() else 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 or more GPUs (JAX)")]

# G 8 (model axis up to 8), context shards of 256 tokens >= w - 1 at 8 GPUs.
CFG = NSAConfig(d_model=512, n_heads=16, n_kv_heads=8, d_k=64, d_v=64, cmp_block=32,
                cmp_stride=16, sel_block=64, n_sel=8, window=256)
B, T = 8, 2048
TOL_F32, TOL_F32_GRAD = 1e-5, 1e-4
TOL_16 = 2e-2        # bf16 sharded against bf16 on one GPU (relative L2, whole tensor)
NO_WORSE = 1.25      # bf16: sharded error against float32 <= 1.25 x the one-GPU error + BF16_U
# One more bf16 rounding (its unit roundoff): a parameter's gradient summed over a data or
# context axis is the psum of per-device bf16 partial sums, each rounded before the sum (measured:
# `bg` on 4 data shards, 0.0064 against the one-GPU 0.0037).
BF16_U = 2.0 ** -8


def meshes(n_devices: int) -> list[dict[str, int]]:
    """Every mesh of 2, 4 or 8 devices that n_devices allow: each axis alone, then pairs of
    axes (4 devices), then all three (8)."""
    out = []
    for k in (2, 4, 8):
        if k <= n_devices:
            out += [dict(data=k), dict(model=k), dict(context=k)]
    if n_devices >= 4:
        out += [dict(data=2, model=2), dict(data=2, context=2), dict(model=2, context=2)]
    if n_devices >= 8:
        out += [dict(data=2, model=2, context=2)]
    return out


def _mesh_id(sizes: dict[str, int]) -> str:
    return "_".join(f"{name}{size}" for name, size in sizes.items())


MESHES = meshes(_gpu_count())


@functools.lru_cache(maxsize=None)
def _inputs(dtype=jnp.float32):
    params, x = make_inputs(CFG, B, T, jnp.float32, seed=7)
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), (params, x))


# FlashAttention-3 off: the fused branches on cuDNN's own kernel (the one GPU and the shards).
CUDNN_ONLY = (("xla", nsa_jax.XlaOptions(fa3=False)), ("pallas", nsa_jax.PallasOptions(fa3=False)))


@functools.lru_cache(maxsize=None)
def _one_gpu(backend, dtype=jnp.float32, options=None):
    """The unsharded layer on the first GPU (computed once per backend, dtype and options)."""
    params, x = _inputs(dtype)
    with jax.default_device(jax.devices("gpu")[0]):
        return loss_and_grads(
            lambda p, x: nsa_jax.nsa_attention(p, x, CFG, backend=backend, return_aux=True,
                                               options=dict(options) if options else None),
            params, x)


def _sharded(params, x, sizes, backend, options=None):
    mesh, axes = make_mesh(**sizes)
    params = sharding.shard_params(params, CFG, mesh, axes)
    x = jax.device_put(x, NamedSharding(mesh, sharding.input_spec(axes)))
    return loss_and_grads(
        lambda p, x: sharding.sharded_nsa_attention(p, x, CFG, mesh, axes=axes, backend=backend,
                                                    return_aux=True,
                                                    options=dict(options) if options else None),
        params, x)


def _cases():
    for sizes in MESHES:
        yield pytest.param(sizes, "xla", id=f"{_mesh_id(sizes)}-xla")
        if "context" not in sizes:  # the Pallas kernels take no context axis
            yield pytest.param(sizes, ("pallas", "xla"), id=f"{_mesh_id(sizes)}-pallas")


@pytest.mark.parametrize("sizes, backend", list(_cases()))
def test_float32_matches_one_gpu(sizes, backend):
    params, x = _inputs()
    y_ref, aux_ref, grads_ref = _one_gpu(backend)
    y, aux, grads = _sharded(params, x, sizes, backend)
    assert rel_err(y, y_ref) <= TOL_F32
    for name in ("o_cmp", "o_sel", "o_win", "gates"):
        assert rel_err(aux[name], aux_ref[name]) <= TOL_F32, name
    np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])
    errors = grad_errors(grads, grads_ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL_F32_GRAD, (worst, errors[worst])


@pytest.mark.parametrize("sizes, backend", list(_cases()))
def test_bfloat16_no_less_accurate_than_one_gpu(sizes, backend):
    _assert_bf16_like_one_gpu(_sharded(*_inputs(jnp.bfloat16), sizes, backend), backend)


def _assert_bf16_like_one_gpu(sharded, backend, options=None):
    """The bf16 sharded (y, aux, grads) against the one-GPU layer with the same options: within
    TOL_16 of its bf16 output, no less accurate against its float32 result."""
    y, aux, grads = sharded
    y_f32, _, grads_f32 = _one_gpu(backend, jnp.float32, options)
    y_one, aux_one, grads_one = _one_gpu(backend, jnp.bfloat16, options)
    assert rel_err(y, y_one) <= TOL_16
    assert rel_err(y, y_f32) <= NO_WORSE * rel_err(y_one, y_f32) + BF16_U
    # Selections may differ only at near-ties: at most 1% of the (token, head, slot) entries.
    assert np.mean(np.asarray(aux["block_idx"]) != np.asarray(aux_one["block_idx"])) <= 0.01
    err, err_one = grad_errors(grads, grads_f32), grad_errors(grads_one, grads_f32)
    for name, e in err.items():
        assert e <= NO_WORSE * err_one[name] + BF16_U, (name, e, err_one[name])


@pytest.mark.parametrize("sizes", [dict(data=2), dict(model=2)], ids=_mesh_id)
@pytest.mark.parametrize("backend", ["xla", ("pallas", "xla")], ids=["xla", "pallas"])
def test_bfloat16_cudnn_inside_shard_map(sizes, backend, monkeypatch):
    """FA-3 off, so cuDNN's own kernel runs both fused branches inside the multi-device
    `shard_map`, bound below jax's custom_partitioning (through it XLA's compile of this
    gradient segfaults): it compiles, runs there, and is held to the bf16 checks above against
    the same options on one GPU."""
    from nsa_jax.xla import cudnn

    if not cudnn.unpartitioned_ready():
        pytest.skip("this jax lays out its cuDNN primitives otherwise: cuDNN stays off there")
    ran = []
    bound = cudnn._unpartitioned_attention

    def counted(*args):
        ran.append(args[-1])            # the window, None for the compressed branch's causal
        return bound(*args)

    monkeypatch.setattr(cudnn, "_unpartitioned_attention", counted)
    try:
        sharded = _sharded(*_inputs(jnp.bfloat16), sizes, backend, CUDNN_ONLY)
    finally:
        jax.clear_caches()
    assert sorted(set(ran), key=str) == sorted({None, CFG.window}, key=str)
    _assert_bf16_like_one_gpu(sharded, backend, CUDNN_ONLY)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_prefill_and_decode_match_one_gpu(backend):
    """Prefill 1,000 tokens, then 40 decode steps (two emit a compressed block) over the
    largest data x model mesh without a context axis, float32, parameters and cache placed with
    their specs, against the same steps on one GPU."""
    params, x = _inputs()
    n = _gpu_count()
    sizes = dict(data=2, model=n // 2) if n >= 4 else dict(model=2)
    mesh, axes = make_mesh(**sizes)
    prefix, steps, max_len = 1000, 40, 1040
    cache = nsa_jax.init_cache(CFG, B, max_len)
    with jax.default_device(jax.devices("gpu")[0]):
        y_ref, cache_ref = nsa_jax.prefill(params, x[:, :prefix], CFG, cache, backend=backend)
    sharded_params = sharding.shard_params(params, CFG, mesh, axes)
    y, cache_sh = sharding.sharded_prefill(sharded_params, x[:, :prefix], CFG,
                                           sharding.shard_cache(cache, CFG, mesh, axes), mesh,
                                           axes=axes, backend=backend)
    assert rel_err(y, y_ref) <= TOL_F32
    step = jax.jit(lambda p, x_t, c: sharding.sharded_decode_step(
        p, x_t, CFG, c, mesh, axes=axes, backend=backend, return_aux=True))
    step_ref = jax.jit(lambda p, x_t, c: nsa_jax.decode_step(
        p, x_t, CFG, c, backend=backend, return_aux=True))
    for t in range(prefix, prefix + steps):
        y_ref, cache_ref, _, aux_ref = step_ref(params, x[:, t:t + 1], cache_ref)
        y, cache_sh, _, aux = step(sharded_params, x[:, t:t + 1], cache_sh)
        assert rel_err(y, y_ref) <= TOL_F32, t
        np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"], err_msg=str(t))
