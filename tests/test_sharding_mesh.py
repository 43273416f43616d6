"""nsa_jax.sharding on 8 fake CPU devices: sharded == unsharded (forward, aux, gradients and
their shardings, prefill + decode) over data, model and context axes alone and combined, the
Pallas path in interpret mode, and the errors of a mesh that does not fit.

Needs `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts: `test_sharding.py`
runs this module in such a subprocess (the tests marked slow in two more, as the suite's slow
run); in the ordinary one-device run it skips. The default run keeps the three axes combined, the
halo-free context split, packed sequences and the errors; each axis alone, the Pallas and FA-3
paths, decode and the scripts are the slow ones.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import nsa_jax
from jax_inputs import AUX_FLOAT, make_inputs
from sharding_helpers import grad_errors, loss_and_grads, make_mesh
from nsa_common.testing import rel_err
from nsa_common import NSAConfig
from nsa_jax import core, sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (run through test_sharding.py)")

TOL = 1e-10      # float64: the sharded layer only reorders sums
F32_TOL = 1e-5   # the spec's float32 tolerance (the Pallas kernels do not run in float64)
CFG = NSAConfig.tiny()  # H 4, G 2, l 8, d 4, l_sel 16, w 16
B, T = 2, 64            # 4 context shards of 16 tokens >= w - 1


@pytest.fixture(scope="module")
def reference():
    """Inputs and the unsharded layer's outputs and gradients (float64), computed once."""
    from conftest import enable_x64

    with enable_x64():  # only while computing: the float32 tests below need it off
        params, x = make_inputs(CFG, B, T, jnp.float64, seed=3)
        out = loss_and_grads(
            lambda p, x: nsa_jax.nsa_attention(p, x, CFG, return_aux=True), params, x)
    return (params, x) + out


def assert_grads_match(grads, ref_grads, tol=TOL):
    """Every gradient leaf within tol (`cmp_k.b2`'s against the RMS of all gradients)."""
    for name, error in grad_errors(grads, ref_grads).items():
        assert error <= tol, name


def assert_sharded_like(tree, specs, mesh):
    """Each leaf's sharding is NamedSharding(mesh, spec) (trailing Nones aside)."""
    for leaf, spec in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            leaf.sharding, spec)


@pytest.mark.parametrize("sizes", [pytest.param(dict(data=2), marks=pytest.mark.slow),
                                   pytest.param(dict(model=2), marks=pytest.mark.slow),
                                   pytest.param(dict(context=4), marks=pytest.mark.slow),
                                   dict(data=2, model=2, context=2)],
                         ids=["data", "model", "context", "data_model_context"])
def test_layer_matches_unsharded(x64, reference, sizes):
    params, x, y_ref, aux_ref, grads_ref = reference
    mesh, axes = make_mesh(**sizes)
    y, aux, grads = loss_and_grads(
        lambda p, x: sharding.sharded_nsa_attention(p, x, CFG, mesh, axes=axes, return_aux=True),
        params, x)
    assert rel_err(y, y_ref) <= TOL
    for name in AUX_FLOAT:
        assert rel_err(aux[name], aux_ref[name]) <= TOL, name
    np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])
    assert_grads_match(grads, grads_ref)
    assert_sharded_like(grads[0], sharding.param_specs(CFG, axes), mesh)
    assert_sharded_like([y, grads[1]], [sharding.input_spec(axes)] * 2, mesh)


@pytest.mark.slow
def test_pallas_layer_matches_unsharded():
    """Pallas compressed attention, selection, selected and window attention (the window
    kernel opted in; interpret mode) inside shard_map over data x model, forward and gradients,
    against the unsharded XLA layer."""
    params, x = make_inputs(CFG, B, T, jnp.float32, seed=3)
    y_ref, aux_ref, grads_ref = loss_and_grads(
        lambda p, x: nsa_jax.nsa_attention(p, x, CFG, return_aux=True), params, x)
    mesh, axes = make_mesh(data=2, model=2)
    options = {"pallas": nsa_jax.PallasOptions(window_kernel=True)}
    y, aux, grads = loss_and_grads(
        lambda p, x: sharding.sharded_nsa_attention(p, x, CFG, mesh, axes=axes,
                                                    backend=("pallas", "xla"), options=options,
                                                    return_aux=True),
        params, x)
    assert rel_err(y, y_ref) <= F32_TOL
    np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])
    assert_grads_match(grads, grads_ref, F32_TOL)
    assert_sharded_like(grads[0], sharding.param_specs(CFG, axes), mesh)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_decode_matches_unsharded(backend):
    """Prefill 36 tokens, then 3 steps (one emits a compressed block) over data x model, on
    parameters and a cache placed with their specs (float32: the Pallas decode kernels)."""
    params, x = make_inputs(CFG, B, T, jnp.float32, seed=3)
    mesh, axes = make_mesh(data=2, model=2)
    prefix, steps, max_len = 36, 3, 40
    cache = nsa_jax.init_cache(CFG, B, max_len)
    y_ref, cache_ref = nsa_jax.prefill(params, x[:, :prefix], CFG, cache)
    sharded_params = sharding.shard_params(params, CFG, mesh, axes)
    y, cache_sh = sharding.sharded_prefill(sharded_params, x[:, :prefix], CFG,
                                           sharding.shard_cache(cache, CFG, mesh, axes), mesh,
                                           axes=axes)
    assert rel_err(y, y_ref) <= F32_TOL
    for t in range(prefix, prefix + steps):
        y_ref, cache_ref, reads_ref, aux_ref = nsa_jax.decode_step(
            params, x[:, t:t + 1], CFG, cache_ref, return_aux=True, backend=backend)
        y, cache_sh, reads, aux = sharding.sharded_decode_step(
            sharded_params, x[:, t:t + 1], CFG, cache_sh, mesh, axes=axes, backend=backend,
            return_aux=True)
        assert rel_err(y, y_ref) <= F32_TOL, t
        np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])
        assert {k: np.asarray(v).tolist() for k, v in reads.items()} == {
            k: np.asarray(v).tolist() for k, v in reads_ref.items()}
    for name, got, want in zip(nsa_jax.DecodeCache._fields, cache_sh, cache_ref):
        if name in ("lengths", "overflow"):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert rel_err(got, want) <= F32_TOL, name
    assert_sharded_like(cache_sh, sharding.cache_specs(CFG, axes), mesh)


def test_cudnn_kernel_inside_a_multi_device_shard_map(monkeypatch):
    """body_options: where jax's cuDNN primitives can be bound below their custom_partitioning
    the options pass as given; where not, cuDNN's own kernel is off (both backends) with more
    than one device, FA-3 and the caller's other options kept; a one-device mesh keeps the
    options as given."""
    from nsa_jax.xla import cudnn

    mesh, _ = make_mesh(data=2)
    given = {"xla": nsa_jax.XlaOptions(window_q_chunk=64)}
    assert cudnn.unpartitioned_ready()          # jax 0.10.2 to 0.11.2 lay the primitives out so
    assert sharding.body_options(given, mesh) == given
    assert sharding.body_options(None, mesh) is None
    monkeypatch.setattr(cudnn, "unpartitioned_ready", lambda: False)
    opts = sharding.body_options(given, mesh)
    assert opts["xla"] == nsa_jax.XlaOptions(window_q_chunk=64, cudnn_kernel=False)
    assert opts["pallas"] == nsa_jax.PallasOptions(cudnn_kernel=False)
    one, _ = make_mesh(data=1)
    assert sharding.body_options(None, one) is None
    given = {"pallas": nsa_jax.PallasOptions(interpret=True)}
    assert sharding.body_options(given, one) == given


def test_manual_region_is_seen_inside_shard_map_only():
    """cudnn.in_manual_region: false under plain jit, true inside a `shard_map` (the cuDNN calls
    then skip jax's custom_partitioning)."""
    from jax.sharding import PartitionSpec as P
    from nsa_jax.xla import cudnn

    seen = []

    def body(x):
        seen.append(cudnn.in_manual_region())
        return x

    mesh, _ = make_mesh(data=2)
    jax.jit(body)(jnp.ones(4))
    jax.jit(sharding.shard_map(body, mesh, in_specs=P("data"), out_specs=P("data")))(
        jnp.ones(4))
    assert seen == [False, True]


@pytest.mark.slow
def test_fa3_runs_inside_a_multi_device_shard_map(x64, reference, monkeypatch):
    """Inside a `shard_map` over data x model, both fused branches run on FA-3 (float64
    stand-ins, the fused gate opened on the CPU) and cuDNN's own kernel never: output, aux and
    gradients equal the unsharded chunked layer's."""
    from fa3_stand_in import open_fa3_paths
    from nsa_jax.xla import cudnn

    params, x, y_ref, aux_ref, grads_ref = reference

    def no_cudnn(*args, **kwargs):
        raise AssertionError("cuDNN's own kernel ran inside a multi-device shard_map")

    taken = open_fa3_paths(monkeypatch)
    monkeypatch.setattr(cudnn, "causal_attention", no_cudnn)
    monkeypatch.setattr(jax.nn, "dot_product_attention", no_cudnn)
    mesh, axes = make_mesh(data=2, model=2)
    try:
        y, aux, grads = loss_and_grads(
            lambda p, x: sharding.sharded_nsa_attention(p, x, CFG, mesh, axes=axes,
                                                        return_aux=True), params, x)
    finally:
        jax.clear_caches()  # no compiled program of the patched paths outlives the patches
    # FA-3's (left, right) windows: those of the fused branches, and where CFG selects every
    # block of x, the selected branch's causal attention (w = T).
    T = x.shape[1]
    every = [(T - 1, 0)] if core.selects_every_block(CFG, T) else []
    assert sorted(set(taken)) == sorted([(-1, -1), (CFG.window - 1, 0)] + every)
    assert rel_err(y, y_ref) <= TOL
    for name in AUX_FLOAT:
        assert rel_err(aux[name], aux_ref[name]) <= TOL, name
    np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])
    assert_grads_match(grads, grads_ref)


@pytest.mark.slow
def test_cudnn_repro_script(capsys):
    """scripts/repro_cudnn_shard_map.py: a case compiles and runs here (no cuDNN on a CPU), the
    bypass of body_options is undone, and an unknown case is refused by name."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        "repro_cudnn_shard_map.py")
    spec = importlib.util.spec_from_file_location("repro_cudnn_shard_map", path)
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    keep = sharding.body_options
    assert repro.main(["layer_grad_nocudnn"]) == 0
    assert "layer_grad_nocudnn: ok" in capsys.readouterr().out
    assert sharding.body_options is keep
    with pytest.raises(ValueError, match="case .* must be one of"):
        repro.main(["layer_bwd"])


def test_context_without_halos():
    """l = d and w = 1 (no halo on either side), mean compression, shared K/V, 8 shards."""
    cfg = CFG.replace(cmp_block=4, window=1, compress="mean", shared_kv=True)
    params, x = make_inputs(cfg, B, T, jnp.float32, seed=5)
    mesh, axes = make_mesh(context=8)
    y, aux = sharding.sharded_nsa_attention(params, x, cfg, mesh, axes=axes, return_aux=True)
    y_ref, aux_ref = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    assert rel_err(y, y_ref) <= F32_TOL
    np.testing.assert_array_equal(aux["block_idx"], aux_ref["block_idx"])


def test_packed_sequences_over_model_axis():
    """cu_seqlens (replicated) with the heads split over the model axis."""
    params, x = make_inputs(CFG, 1, T, jnp.float32, seed=4)
    cu_seqlens = jnp.array([0, 21, T], jnp.int32)
    mesh, axes = make_mesh(model=2)
    y = sharding.sharded_nsa_attention(params, x, CFG, mesh, axes=axes, cu_seqlens=cu_seqlens)
    assert rel_err(y, nsa_jax.nsa_attention(params, x, CFG, cu_seqlens=cu_seqlens)) <= F32_TOL


@pytest.mark.parametrize("sizes, cfg, shape, message", [
    (dict(model=4), CFG, (B, T), "n_kv_heads G (2) must be divisible by the size of mesh axis "
                                 "'model' (4)"),
    (dict(data=4), CFG, (B, T), "batch size B (2) must be divisible by the size of mesh axis "
                                "'data' (4)"),
    (dict(context=8), CFG, (B, T), "tokens per shard of mesh axis 'context' (8) must be >= 15"),
    (dict(context=4), CFG, (B, 62), "sequence length T (62) must be divisible"),
    (dict(context=2), CFG, (B, 36), "tokens per shard of mesh axis 'context' (18) must be a "
                                    "multiple of cmp_stride (4)"),
])
def test_mesh_that_does_not_fit(sizes, cfg, shape, message):
    mesh, axes = make_mesh(**sizes)
    params, x = make_inputs(cfg, *shape, jnp.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        sharding.sharded_nsa_attention(params, x, cfg, mesh, axes=axes)


def test_bad_axes_and_backend():
    params, x = make_inputs(CFG, B, T, jnp.float32)
    mesh, _ = make_mesh(data=2, context=2)
    with pytest.raises(ValueError, match=r"axes.model \('model'\) is not an axis of the mesh"):
        sharding.sharded_nsa_attention(params, x, CFG, mesh)  # default axes name "model"
    axes = sharding.MeshAxes(data="data", model=None, context="context")
    # "pallas" falls back to XLA by registration (so it runs a context axis on XLA); a backend
    # with no XLA fallback is refused.
    nsa_jax.register_backend("sliding_window_attention", "window_only",
                             lambda q, k, v, **kw: q)
    with pytest.raises(ValueError, match="backend .* must include 'xla' with a context axis"):
        sharding.sharded_nsa_attention(params, x, CFG, mesh, axes=axes, backend="window_only")
    with pytest.raises(ValueError, match="cu_seqlens .* needs mesh axes data and context"):
        sharding.sharded_nsa_attention(params, x[:1], CFG, mesh,
                                       axes=sharding.MeshAxes(data=None, model=None,
                                                              context="context"),
                                       cu_seqlens=jnp.array([0, 10, T], jnp.int32))


@pytest.mark.slow
def test_bench_scaling_smoke(tmp_path, monkeypatch):
    """bench/bench_scaling.py at tiny sizes: every row ok, efficiency against the first mesh, and
    the weak rows (same shapes as the strong ones here: no context axis) not timed again."""
    from bench import bench_scaling, common

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    path = tmp_path / "scaling.csv"
    code = bench_scaling.main(["--device", "cpu", "--preset", "tiny", "--tokens", "32",
                               "--meshes", "1x1x1,1x2x1", "--dtype", "float32", "--iters", "1",
                               "--warmup", "1", "--repeats", "1", "--csv", str(path)])
    assert code == 0
    rows = common.read_csv(str(path))
    assert list(rows[0]) == bench_scaling.COLUMNS
    got = {(r["scaling"], r["mesh"], r["pass"]): r for r in rows}
    assert set(got) == {(s, m, p) for s in bench_scaling.SCALINGS for m in ("1x1x1", "1x2x1")
                        for p in bench_scaling.PASSES}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and int(r["T"]) == 32
               and float(r["context_mib"]) == 0 for r in rows)  # no context axis: no traffic
    for p in bench_scaling.PASSES:
        assert float(got[("strong", "1x1x1", p)]["efficiency"]) == 1
        for mesh in ("1x1x1", "1x2x1"):
            assert got[("weak", mesh, p)]["ms"] == got[("strong", mesh, p)]["ms"]
