"""`nsa_jax.native_sparse_attention` (the core over projected tensors) against the float64 brute
force and the layer; packed inputs as lists; `precision`; the `"pallas"` fallback; errors; and
the light import (`import nsa_jax` pulls no torch)."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from bruteforce import (bf_compress, bf_compressed_attention, bf_select_blocks,
                        bf_selected_attention, bf_sliding_window_attention)
from jax_inputs import AUX_FLOAT, dot_precisions, make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig
from nsa_jax import dispatch
from nsa_jax.core import BRANCH_NAMES
from nsa_jax.layer import project

TOL = 1e-10  # float64 against the float64 brute force


def core_inputs(cfg, B, T, dtype, *, shared, seed=0):
    """Random q `[B, T, H, d_k]`, k / v (shared or per branch), gate logits, cmp_params."""
    rng = np.random.default_rng(seed)
    H, G, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q = normal(B, T, H, dk)
    if shared:
        k, v = normal(B, T, G, dk), normal(B, T, G, dv)
    else:
        k = {c: normal(B, T, G, dk) for c in BRANCH_NAMES}
        v = {c: normal(B, T, G, dv) for c in BRANCH_NAMES}
    gate_logits = normal(B, T, H, 3)
    cmp_params = None
    if cfg.compress == "mlp":
        params = nsa_jax.init_params(jax.random.PRNGKey(seed), cfg, dtype)
        cmp_params = {"cmp_k": params["cmp_k"], "cmp_v": params["cmp_v"]}
    return q, k, v, gate_logits, cmp_params


def bf_core(q, k, v, gates, cmp_params, cfg, scale):
    """The brute force's branches composed as in spec steps 4-9 (float64, NumPy)."""
    k = k if isinstance(k, dict) else {c: k for c in BRANCH_NAMES}
    v = v if isinstance(v, dict) else {c: v for c in BRANCH_NAMES}
    q, gates = np.asarray(q), np.asarray(gates)
    np_tree = lambda t: jax.tree_util.tree_map(np.asarray, t)
    mlp = cfg.compress == "mlp"
    k_cmp = bf_compress(np.asarray(k["cmp"]), np_tree(cmp_params["cmp_k"]) if mlp else None, cfg)
    v_cmp = bf_compress(np.asarray(v["cmp"]), np_tree(cmp_params["cmp_v"]) if mlp else None, cfg)
    o_cmp, _ = bf_compressed_attention(q, k_cmp, v_cmp, cfg, scale)
    block_idx = bf_select_blocks(q, k_cmp, cfg, scale)
    o_sel = bf_selected_attention(q, np.asarray(k["sel"]), np.asarray(v["sel"]), block_idx,
                                  cfg.sel_block, scale)
    o_win = bf_sliding_window_attention(q, np.asarray(k["win"]), np.asarray(v["win"]),
                                        cfg.window, scale)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
    return o, dict(o_cmp=o_cmp, o_sel=o_sel, o_win=o_win, block_idx=block_idx, k_cmp=k_cmp,
                   v_cmp=v_cmp)


CORE_CASES = {
    # name: (cfg, B, T, shared k/v, gates as logits, scale)
    "mlp-per-branch-logits": (NSAConfig.tiny(), 2, 37, False, True, None),
    "mean-shared-values-scale": (NSAConfig.tiny(compress="mean", n_heads=8), 1, 42, True, False,
                                 0.3),
    "G1-short-window": (NSAConfig.tiny(n_heads=2, n_kv_heads=1, d_k=8, d_v=16, window=5,
                                       n_sel=3, n_local=1), 1, 29, False, False, None),
}


@pytest.mark.parametrize("name", list(CORE_CASES))
def test_core_matches_bruteforce(x64, name):
    cfg, B, T, shared, logits, scale = CORE_CASES[name]
    q, k, v, gate_logits, cmp_params = core_inputs(cfg, B, T, jnp.float64, shared=shared)
    gates = jax.nn.sigmoid(gate_logits)
    o, aux = nsa_jax.native_sparse_attention(
        q, k, v, gate_logits if logits else gates, cfg, cmp_params=cmp_params,
        gates_are_logits=logits, scale=scale, return_aux=True)
    ref_o, ref = bf_core(q, k, v, gates, cmp_params, cfg,
                         1 / np.sqrt(cfg.d_k) if scale is None else scale)
    assert o.shape == (B, T, cfg.n_heads, cfg.d_v) and o.dtype == q.dtype
    assert rel_err(o, ref_o) <= TOL
    for key in ("o_cmp", "o_sel", "o_win", "k_cmp", "v_cmp"):
        assert rel_err(aux[key], ref[key]) <= TOL, key
    assert rel_err(aux["gates"], gates) <= TOL
    np.testing.assert_array_equal(aux["block_idx"], ref["block_idx"])
    # lse: log of the compressed softmax denominator; -inf before the first block (t < l - 1).
    lse = np.asarray(aux["lse"])
    assert np.all(np.isneginf(lse[:, :cfg.cmp_block - 1]))
    assert np.all(np.isfinite(lse[:, cfg.cmp_block - 1:]))


def test_core_is_the_layer_between_projections_and_output(x64):
    """The layer = project -> core -> wo: its output and aux come back from the core's."""
    cfg = NSAConfig.tiny(shared_kv=True)
    params, x = make_inputs(cfg, 2, 30, jnp.float64, seed=1)
    y, aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    proj = project(params, x, cfg, jnp.arange(30))
    logits = (x @ params["wg"] + params["bg"]).reshape(2, 30, cfg.n_heads, 3)
    o, core_aux = nsa_jax.native_sparse_attention(
        proj["q"], proj["k_sel"], proj["v_sel"], logits, cfg, gates_are_logits=True,
        cmp_params={"cmp_k": params["cmp_k"], "cmp_v": params["cmp_v"]}, return_aux=True)
    assert rel_err(o.reshape(2, 30, -1) @ params["wo"], y) <= TOL
    for key in AUX_FLOAT:
        assert rel_err(core_aux[key], aux[key]) <= TOL, key
    np.testing.assert_array_equal(core_aux["block_idx"], aux["block_idx"])


@pytest.mark.slow
def test_core_gradients_match_finite_differences(x64):
    cfg = NSAConfig.tiny(n_heads=2, n_kv_heads=1, d_k=8, d_v=4)
    q, k, v, gate_logits, cmp_params = core_inputs(cfg, 1, 17, jnp.float64, shared=False,
                                                   seed=2)
    core = jax.jit(lambda q, k, v, g, p: nsa_jax.native_sparse_attention(
        q, k, v, g, cfg, cmp_params=p, gates_are_logits=True))
    jax.test_util.check_grads(core, (q, k, v, gate_logits, cmp_params), order=1, modes=["rev"],
                              atol=1e-5, rtol=1e-5)


def test_packed_core_takes_lists_and_equals_separate(x64):
    cfg = NSAConfig.tiny()
    q, k, v, gates, cmp_params = core_inputs(cfg, 1, 40, jnp.float64, shared=True, seed=3)
    run = lambda q, k, v, g, **kw: nsa_jax.native_sparse_attention(
        q, k, v, g, cfg, cmp_params=cmp_params, **kw)
    cu = [0, 13, 40]
    packed = run(q, k, v, gates, cu_seqlens=cu)
    np.testing.assert_array_equal(run(q, k, v, gates, cu_seqlens=np.array(cu)), packed)
    for s, e in zip(cu[:-1], cu[1:]):
        assert rel_err(packed[:, s:e], run(q[:, s:e], k[:, s:e], v[:, s:e], gates[:, s:e])) <= TOL


def test_layer_takes_cu_seqlens_as_a_list():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 20, jnp.float32, seed=4)
    as_array = nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=jnp.array([0, 9, 20], jnp.int32))
    np.testing.assert_array_equal(nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=[0, 9, 20]),
                                  as_array)


# -- precision -----------------------------------------------------------------------------------
def test_precision_reaches_every_matmul_forward_and_backward():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 20, jnp.float32, seed=5)

    def precisions(precision):
        loss = lambda p: jnp.sum(nsa_jax.nsa_attention(p, x, cfg, precision=precision))
        return dot_precisions(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    # conftest runs the suite under "highest"; None here is JAX's own default for the dtype.
    with jax.default_matmul_precision(None):
        # projections, compression MLP, compressed, selected and window scores, and backward
        assert len(precisions("highest")) > 20
        assert set(precisions("highest")) == {highest}
        assert set(precisions(jax.lax.Precision.HIGHEST)) == {highest}
        assert set(precisions(None)) == {None}
        with jax.default_matmul_precision("float32"):  # ... or the caller's own setting
            assert set(precisions(None)) == {highest}


def test_core_precision_reaches_every_matmul():
    cfg = NSAConfig.tiny(compress="mean")
    q, k, v, gates, _ = core_inputs(cfg, 1, 20, jnp.float32, shared=True, seed=6)
    jaxpr = jax.make_jaxpr(lambda q: nsa_jax.native_sparse_attention(
        q, k, v, gates, cfg, precision="highest"))(q)
    precisions = dot_precisions(jaxpr.jaxpr)
    assert len(precisions) >= 5 and set(precisions) == {(jax.lax.Precision.HIGHEST,) * 2}


# -- backends ------------------------------------------------------------------------------------
def test_pallas_alone_means_pallas_then_xla():
    assert dispatch.backend_names("pallas") == ("pallas", "xla")
    assert dispatch.backend_names(("pallas", "xla")) == ("pallas", "xla")
    assert dispatch.backend_names("xla") == ("xla",)


def test_core_pallas_backend_matches_xla():
    """Compression and the window run on XLA, the rest on the Pallas kernels (interpret
    mode)."""
    cfg = NSAConfig.tiny(n_sel=3)
    q, k, v, gates, cmp_params = core_inputs(cfg, 1, 17, jnp.float32, shared=False, seed=7)
    run = lambda backend: nsa_jax.native_sparse_attention(
        q, k, v, gates, cfg, cmp_params=cmp_params, backend=backend, return_aux=True)
    (o_pl, aux_pl), (o_xla, aux_xla) = run("pallas"), run("xla")
    np.testing.assert_array_equal(aux_pl["block_idx"], aux_xla["block_idx"])
    assert rel_err(o_pl, o_xla) <= 1e-5  # the spec's float32 tolerance


# -- errors --------------------------------------------------------------------------------------
def test_core_errors_name_the_argument():
    cfg = NSAConfig.tiny()
    q, k, v, gates, cmp_params = core_inputs(cfg, 1, 12, jnp.float32, shared=False)
    mean = cfg.replace(compress="mean")

    def run(q=q, k=k, v=v, gates=gates, cfg=cfg, **kw):
        kw.setdefault("cmp_params", cmp_params if cfg.compress == "mlp" else None)
        return nsa_jax.native_sparse_attention(q, k, v, gates, cfg, **kw)

    cases = [
        (lambda: run(q=q[0]), "q must be a rank-4"),
        (lambda: run(k={"cmp": k["cmp"], "sel": k["sel"]}), r"k must be .* keys \['cmp'"),
        (lambda: run(k=dict(k, sel=k["sel"][..., :8])), r"k\['sel'\] has head dim"),
        (lambda: run(v=dict(v, win=v["win"][:, :6])), r"v\['win'\] has \[B, T, G\]"),
        (lambda: run(v=dict(v, sel=v["sel"][..., :4])), r"v\['sel'\] has shape"),
        (lambda: run(q=jnp.zeros((1, 12, 3, cfg.d_k))), "not a multiple"),
        (lambda: run(gates=gates[..., :2]), "gates has shape"),
        (lambda: run(cmp_params=None), "cmp_params must be .* compress='mlp'"),
        (lambda: run(cfg=mean, cmp_params=cmp_params), "cmp_params must be None"),
        (lambda: run(cmp_params={"cmp_k": cmp_params["cmp_k"]}), r"cmp_params\['cmp_v'\]"),
        (lambda: run(cu_seqlens=[0.0, 12.0]), "cu_seqlens must hold integers"),
        (lambda: run(cu_seqlens=[0, 5]), "cu_seqlens"),
        (lambda: run(precision="fast"), "precision"),
        (lambda: run(backend="nope"), "known backends"),
        (lambda: dispatch.register_fallback("pallas", "pallas"), "fallback"),
        (lambda: dispatch.register_fallback("", "xla"), "backend"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


# -- packaging -----------------------------------------------------------------------------------
def test_import_is_light_and_versioned():
    """`import nsa_jax` (and the layer) never imports torch, flax or the parity / bench tools."""
    code = ("import sys, nsa_jax; "
            "heavy = [m for m in ('torch', 'triton', 'flax', 'yaml', 'tqdm', 'matplotlib') "
            "if m in sys.modules]; "
            "print(nsa_jax.__version__, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    version, heavy = out.stdout.split(" ", 1)
    assert heavy.strip() == "[]", heavy
    assert version.count(".") == 2
