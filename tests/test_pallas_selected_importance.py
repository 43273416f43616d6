"""NSA's log group importance at the selected blocks (`pallas_kernels.selected_importance`,
interpret mode on CPU; the `gpu` test compiles it): the reference against a NumPy float64 brute
force, the kernels' value and gradients (q, k_cmp, lse) against the reference, the XLA dispatch
entry against both, and the sparse alignment loss on the kernels equal to it on XLA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import enable_x64, jax_has_gpu
from jax_inputs import make_inputs as layer_inputs
from nsa_common import NSAConfig, num_cmp_blocks, overlap_by_offset
from nsa_jax import xla
from nsa_jax.alignment import AlignmentOptions, selection_alignment_loss
from pallas_kernels.selected_importance import (selected_importance,
                                                selected_importance_reference)

# l 16, d 8, l_sel 32: r 4, overlap offsets -1..3 (five compressed blocks per selection block).
CFG = NSAConfig.tiny().replace(cmp_block=16, cmp_stride=8, sel_block=32, n_sel=4)
KW = dict(cmp_block=16, cmp_stride=8, sel_block=32, weights=overlap_by_offset(CFG))


def make_inputs(dtype, seed=0, B=2, T=200, H=6, G=2, d_k=24, n_sel=4):
    """h = 3 (rows padded to 16), d_k 24 (padded to 32), C 24 (the last tile clamped); slots
    of -1, block 0 (offset -1 before the first compressed block), the query's own last block
    (compressed blocks past it not admissible); lse -inf for the first tokens and one head."""
    C = num_cmp_blocks(CFG, T)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (B, T, H, d_k), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, C, G, d_k), jnp.float32).astype(dtype)
    lse = np.asarray(jax.random.normal(keys[2], (B, T, H), jnp.float32)) + 2.0
    lse[:, :CFG.cmp_block - 1] = -np.inf
    lse[0, 3 * T // 4, 1] = -np.inf
    last = np.arange(T) // CFG.sel_block
    blocks = np.asarray(jax.random.randint(keys[3], (B, T, G, n_sel), -1, last.max() + 1))
    blocks = np.minimum(blocks, last[None, :, None, None])
    blocks[:, :, 0, 0] = 0
    blocks[:, :, 1, 0] = last[None, :]
    return q, k, jnp.asarray(lse), jnp.asarray(blocks, jnp.int32)


def bruteforce(q, k, lse, blocks, scale):
    """float64 loops over (b, t, g, slot): log sum_h sum_m w_m exp(q k_c * scale - lse_h)."""
    q, k, lse = (np.asarray(a, np.float64) for a in (q, k, lse))
    blocks = np.asarray(blocks)
    B, T, H, _ = q.shape
    C, G = k.shape[1], k.shape[2]
    h, r = H // G, CFG.sel_block // CFG.cmp_stride
    out = np.full(blocks.shape, -np.inf)
    for b, t, g, i in np.ndindex(*blocks.shape):
        j = blocks[b, t, g, i]
        total = 0.0
        for m, w in overlap_by_offset(CFG):
            c = j * r + m
            if j < 0 or not 0 <= c < C or c * CFG.cmp_stride + CFG.cmp_block - 1 > t:
                continue
            for head in range(g * h, (g + 1) * h):
                if np.isfinite(lse[b, t, head]):
                    total += w * np.exp(q[b, t, head] @ k[b, c, g] * scale - lse[b, t, head])
        if total > 0:
            out[b, t, g, i] = np.log(total)
    return out


def test_reference_matches_float64_bruteforce():
    q, k, lse, blocks = make_inputs(jnp.float32, B=1, T=120)
    scale = 0.3
    with enable_x64():
        got = selected_importance_reference(q.astype(jnp.float64), k.astype(jnp.float64),
                                            lse.astype(jnp.float64), blocks, scale=scale, **KW)
    want = bruteforce(q, k, lse, blocks, scale)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isfinite(want).any() and not np.isfinite(want).all()
    np.testing.assert_allclose(np.where(np.isfinite(want), got, 0.0),
                               np.where(np.isfinite(want), want, 0.0), rtol=1e-12, atol=1e-12)


def _value_and_grads(fn, q, k, lse, blocks, cot):
    def loss(q, k, lse):
        out = fn(q, k, lse, blocks)
        return jnp.sum(jnp.where(jnp.isfinite(out), out * cot, 0.0)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, lse)
    return out, grads


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_kernel_matches_reference_value_and_gradients(dtype, tol):
    q, k, lse, blocks = make_inputs(dtype)
    scale = CFG.d_k ** -0.5
    cot = jax.random.normal(jax.random.PRNGKey(9), blocks.shape, jnp.float32)
    kernel = lambda q, k, l, b: selected_importance(  # noqa: E731
        q, k, l, b, scale=scale, interpret=True, **KW)
    reference = lambda q, k, l, b: selected_importance_reference(  # noqa: E731
        q.astype(jnp.float32), k.astype(jnp.float32), l, b, scale=scale, **KW)
    got, got_grads = _value_and_grads(jax.jit(kernel), q, k, lse, blocks, cot)
    want, want_grads = _value_and_grads(jax.jit(reference), q, k, lse, blocks, cot)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.where(finite, got, 0.0), np.where(finite, want, 0.0),
                               rtol=tol, atol=tol)
    for name, g, w in zip(("dq", "dk_cmp", "dlse"), got_grads, want_grads):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.isfinite(g)), name
        assert np.abs(w).max() > 0.1, name
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err <= tol, f"{name}: relative error {err:.3g}"
    assert not np.any(np.asarray(got_grads[2])[0, 150, 1])        # a head with lse -inf


def test_xla_entry_matches_reference_in_chunks():
    q, k, lse, blocks = make_inputs(jnp.float32)
    scale = CFG.d_k ** -0.5
    got = xla.selected_importance(q, k, lse, blocks, CFG, scale=scale, q_chunk=64)
    want = selected_importance_reference(q, k, lse, blocks, scale=scale, **KW)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.where(finite, got, 0.0), np.where(finite, want, 0.0),
                               rtol=2e-5, atol=2e-5)


def test_bad_inputs_are_named():
    q, k, lse, blocks = make_inputs(jnp.float32, B=1, T=64)
    with pytest.raises(ValueError, match="shapes do not agree"):
        selected_importance(q, k, lse[:, :10], blocks, scale=1.0, interpret=True, **KW)
    with pytest.raises(ValueError, match="takes q"):
        selected_importance(q[0], k, lse, blocks, scale=1.0, interpret=True, **KW)
    with pytest.raises(NotImplementedError, match="consecutive overlap offsets"):
        selected_importance(q, k, lse, blocks, scale=1.0, interpret=True,
                            **dict(KW, weights=((0, 1.0), (2, 1.0))))


def test_sparse_alignment_loss_on_the_kernels_equals_xla():
    """The sparse loss and its gradient with the importance on the kernels (interpret mode)
    against the XLA entry, float32."""
    cfg = CFG.replace(d_model=48, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, window=32, n_sel=6,
                      n_init=1, n_local=1)
    params, x = layer_inputs(cfg, 2, 320, jnp.float32, seed=4)
    alignment = AlignmentOptions(mode="sparse", q_chunk=64)

    def run(backend):
        fn = lambda p: selection_alignment_loss(p, x, cfg, alignment=alignment,  # noqa: E731
                                                backend=backend)
        return jax.jit(jax.value_and_grad(fn))(params)

    (got, got_grads), (want, want_grads) = run("pallas"), run("xla")
    assert float(want) > 1e-3
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_compiled_kernels_decline_below_their_length(monkeypatch):
    """Compiled (not interpret mode), the Pallas entry declines sequences shorter than
    `IMPORTANCE_MIN_T` and the dispatch runs XLA's; from that length it runs the kernels."""
    from nsa_jax import dispatch, pallas_backend

    calls = []
    def kernel(*args, interpret, **kwargs):  # the reference in the kernel's place
        calls.append(args[0].shape[1])
        return selected_importance_reference(*args, **kwargs)

    monkeypatch.setattr(pallas_backend.kernels, "selected_importance", kernel)
    q, k, lse, blocks = make_inputs(jnp.float32)
    options = {"pallas": pallas_backend.PallasOptions(interpret=False)}
    run = lambda: dispatch.call("selected_importance", ("pallas", "xla"), q, k, lse,  # noqa: E731
                                blocks, CFG, scale=0.3, q_chunk=64, options=options)
    want = xla.selected_importance(q, k, lse, blocks, CFG, scale=0.3, q_chunk=64)
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(want))
    assert calls == []
    monkeypatch.setattr(pallas_backend, "IMPORTANCE_MIN_T", q.shape[1])
    run()
    assert calls == [q.shape[1]]


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("d_k", [128, 192])
def test_gpu_kernel_matches_reference(d_k):
    """The compiled kernels, bf16, the bench / paper head sizes, T 4096: value and gradients."""
    q, k, lse, blocks = make_inputs(jnp.bfloat16, B=1, T=4096, H=16, G=2, d_k=d_k, n_sel=16)
    scale = d_k ** -0.5
    cot = jax.random.normal(jax.random.PRNGKey(9), blocks.shape, jnp.float32)
    got, got_grads = _value_and_grads(jax.jit(lambda q, k, l, b: selected_importance(
        q, k, l, b, scale=scale, **KW)), q, k, lse, blocks, cot)
    want, want_grads = _value_and_grads(jax.jit(lambda q, k, l, b: selected_importance_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), l, b, scale=scale, **KW)),
        q, k, lse, blocks, cot)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.where(finite, got, 0.0), np.where(finite, want, 0.0),
                               rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w)
