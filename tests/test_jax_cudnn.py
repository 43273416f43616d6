"""The cuDNN compressed path (`nsa_jax.xla.cudnn`): the compressed mask folded into a causal square.

On a CPU the fold runs with a float64 causal attention in place of cuDNN's, against the float64
brute force and the chunked XLA path (its lse); on a GPU, cuDNN itself against the Pallas kernel.
The FlashAttention-3 wrappers run on a CPU over float64 stand-ins of `flash_attn3_jax`'s forward
and backward primitives (their layout: lse `[B, N, S]`, a `(left, right)` window), and on a GPU
over the real package where it is installed.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bruteforce import bf_compressed_attention
from conftest import jax_has_gpu, skip_above_cudnn_head_dim
from nsa_common import NSAConfig, num_cmp_blocks
from nsa_common.testing import rel_err
from nsa_jax import XlaOptions
from nsa_jax.xla import cudnn
from fa3_stand_in import fa3_backward_f64, fa3_forward_f64, open_fa3_paths
from nsa_jax.xla.compressed_attention import compressed_attention as xla_compressed_attention


def causal_f64(q, k, v, scale):
    """Plain causal GQA attention, q `[B, S, N, d]`, k / v `[B, S, N_kv, d]` -> (o, lse)."""
    B, S, N, _ = q.shape
    group = N // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) * scale
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bnqk,bknd->bqnd", jnp.exp(s - lse[..., None]), v)
    return o, jnp.transpose(lse, (0, 2, 1))


def normal(rng, shape, dtype):
    """Standard normal samples of NumPy's `rng` as a `dtype` array (NumPy draws them: no
    compilation per shape)."""
    return jnp.asarray(rng.standard_normal(shape), dtype)


def inputs(seed, B, T, H, G, d_k, d_v, cfg, dtype):
    C = num_cmp_blocks(cfg, T)
    rng = np.random.default_rng(seed)
    return (normal(rng, (B, T, H, d_k), dtype), normal(rng, (B, C, G, d_k), dtype),
            normal(rng, (B, C, G, d_v), dtype))


def outputs_and_grads(fn, do, *args):
    """`fn(*args)`'s outputs (o, or o and lse) and the gradients of `args` for the cotangent
    `do` on o (zero on the lse), jitted: one compilation instead of one an operation."""
    def run(do, *args):
        out, pullback = jax.vjp(fn, *args)
        cot = (do, jnp.zeros_like(out[1])) if isinstance(out, tuple) else do
        return (*(out if isinstance(out, tuple) else (out,)), *pullback(cot))
    return jax.jit(run)(do, *args)


def after_first_block(result, l):
    """(o, lse, grads...) with the lse's first `l - 1` rows dropped: no compressed block ends
    there, so the lse is -inf (the tests check that apart)."""
    return (result[0], result[1][:, l - 1:], *result[2:])


def assert_close_bf16(got, want, names):
    """Each named output within 2e-2 relative L2 of the other engine's (bf16 against bf16)."""
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        assert rel_err(g.astype(jnp.float32), w.astype(jnp.float32)) <= 2e-2, name


@pytest.mark.parametrize("T,l,d,d_v", [(61, 8, 4, 8), (32, 32, 16, 8)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [(64, 8, 4, 8), (50, 16, 8, 4),
                                                             (33, 4, 4, 8)]])
def test_fold_matches_brute_force(x64, T, l, d, d_v):
    """Output against the brute force and lse against the chunked path, every (l, d), T not a
    multiple of d, d_v < d_k, and one block only (T = l); the queries t < l - 1 give 0 / -inf."""
    cfg = NSAConfig.tiny().replace(cmp_block=l, cmp_stride=d, sel_block=64)
    B, H, G, d_k = 2, 4, 2, 8
    q, k_cmp, v_cmp = inputs(T, B, T, H, G, d_k, d_v, cfg, jnp.float64)
    scale = d_k ** -0.5
    seen = []

    def attend(q_sq, k_sq, v_sq, scale):  # cuDNN's backward takes even lengths only
        seen.append((q_sq.shape[1], k_sq.shape[1]))
        return causal_f64(q_sq, k_sq, v_sq, scale)

    o, lse = jax.jit(lambda q, k, v: cudnn.compressed_attention(q, k, v, cfg, scale=scale,
                                                                attend=attend))(q, k_cmp, v_cmp)
    n = num_cmp_blocks(cfg, T)
    assert seen == [(n + n % 2, n + n % 2)]
    o_bf, _ = bf_compressed_attention(np.asarray(q), np.asarray(k_cmp), np.asarray(v_cmp), cfg,
                                      scale)
    _, lse_ref = jax.jit(lambda q, k, v: xla_compressed_attention(
        q, k, v, cfg, scale=scale, return_lse=True,
        options=XlaOptions(compressed_cudnn=False)))(q, k_cmp, v_cmp)
    assert o.shape == (B, T, H, d_v) and lse.shape == (B, T, H)
    assert rel_err(o, o_bf) <= 1e-12
    assert np.all(np.isneginf(lse[:, :l - 1])) and np.all(np.isfinite(lse[:, l - 1:]))
    assert rel_err(lse[:, l - 1:], lse_ref[:, l - 1:]) <= 1e-12


def test_fold_gradients_match_chunked_path(x64):
    cfg = NSAConfig.tiny().replace(cmp_block=8, cmp_stride=4)
    q, k_cmp, v_cmp = inputs(1, 1, 45, 4, 2, 8, 8, cfg, jnp.float64)
    do = normal(np.random.default_rng(2), q.shape, jnp.float64)

    def grads(fn):
        return jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))(q, k_cmp, v_cmp, do)

    got = grads(lambda q, k, v: cudnn.compressed_attention(q, k, v, cfg, scale=0.3,
                                                            attend=causal_f64)[0])
    want = grads(lambda q, k, v: xla_compressed_attention(
        q, k, v, cfg, scale=0.3, options=XlaOptions(compressed_cudnn=False)))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12


def test_fold_refuses_missing_blocks():
    cfg = NSAConfig.tiny().replace(cmp_block=8, cmp_stride=4)
    q, k_cmp, v_cmp = inputs(0, 1, 32, 4, 2, 8, 8, cfg, jnp.float32)
    with pytest.raises(NotImplementedError, match="compressed blocks"):
        cudnn.compressed_attention(q, k_cmp[:, :-1], v_cmp[:, :-1], cfg, scale=1.0,
                                   attend=causal_f64)
    with pytest.raises(NotImplementedError, match="compressed blocks"):  # T < l: no block
        cudnn.compressed_attention(q[:, :7], k_cmp[:, :0], v_cmp[:, :0], cfg, scale=1.0,
                                   attend=causal_f64)


def test_cpu_never_takes_cudnn():
    x = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    assert cudnn.takes(x, x, x) == (jax.default_backend() == "gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("d_k,d_v", [(128, 128), (192, 128)])
def test_gpu_cudnn_compressed_matches_pallas_kernel(d_k, d_v):
    """cuDNN (folded) against the Pallas kernel on the layer's shapes, o / lse / gradients, bf16."""
    from pallas_kernels import compressed_attention as pallas_compressed_attention

    skip_above_cudnn_head_dim(d_k)
    cfg = NSAConfig.tiny().replace(cmp_block=32, cmp_stride=16, sel_block=64)
    B, T, H, G = 1, 4096, 16, 2
    q, k_cmp, v_cmp = inputs(5, B, T, H, G, d_k, d_v, cfg, jnp.bfloat16)
    assert cudnn.takes(q, k_cmp, v_cmp)
    do = normal(np.random.default_rng(6), (B, T, H, d_v), jnp.bfloat16)
    scale = d_k ** -0.5

    got = outputs_and_grads(lambda q, k, v: cudnn.compressed_attention(
        q, k, v, cfg, scale=scale), do, q, k_cmp, v_cmp)
    want = outputs_and_grads(lambda q, k, v: pallas_compressed_attention(
        q, k, v, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, scale=scale),
        do, q, k_cmp, v_cmp)
    l = cfg.cmp_block
    assert np.all(np.isneginf(np.asarray(got[1][:, :l - 1])))
    assert_close_bf16(after_first_block(got, l), after_first_block(want, l),
                      ("o", "lse", "dq", "dk", "dv"))


def _attention_f64(q, k, v, scale, window):
    """Causal GQA attention in float64, keys `t - window + 1 .. t` (None: all): (o, lse
    `[B, S, N]`)."""
    B, S, N, _ = q.shape
    group = N // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) * scale
    t = jnp.arange(S)
    keep = t[None, :] <= t[:, None]
    if window is not None:
        keep &= t[None, :] > t[:, None] - window
    s = jnp.where(keep, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", jnp.exp(s - lse[..., None]), v), jnp.swapaxes(lse, 1, 2)


def test_cudnn_mla_form_goes_through_the_private_call(x64, monkeypatch):
    """d_v < d_k: v reaches cuDNN unpadded through jax's private function where `mla` (its lse
    `[B, N, S]` turned to `[B, S, N]`), padded otherwise; a call that wants the lse takes the
    private function either way (the public one casts the lse to q's dtype); back to the
    public call, with a warning, when the private one refuses its arguments. Float64 stand-ins
    of both calls; the public one refuses d_v != d_k as jax 0.11.2's does."""
    calls = []

    def public(q, k, v, *, scale, is_causal, implementation, local_window_size=None,
               return_residual=False):
        assert is_causal and implementation == "cudnn"
        if v.shape[-1] != q.shape[-1]:
            raise ValueError("value shape should be [..., d_k]")
        calls.append(("public", v.shape[-1]))
        window = None if local_window_size is None else local_window_size[0] + 1
        o, lse = _attention_f64(q, k, v, scale, window)
        return (o, lse) if return_residual else o

    class MaskType:
        CAUSAL = "causal"

    def private(*, query, key, value, scale, mask_type, sliding_window_length,
                return_residual):
        assert mask_type == "causal"
        calls.append(("private", value.shape[-1]))
        o, lse = _attention_f64(query, key, value, scale, sliding_window_length)
        return (o, jnp.swapaxes(lse, 1, 2)) if return_residual else o

    monkeypatch.setattr(jax.nn, "dot_product_attention", public)
    monkeypatch.setattr(cudnn, "_cudnn_private", lambda: (private, MaskType))
    assert not cudnn.cudnn_mla() or jax.default_backend() == "gpu"
    B, S, N, G, d_k, d_v, scale = 1, 24, 4, 2, 16, 8, 0.3
    rng = np.random.default_rng(3)
    q = normal(rng, (B, S, N, d_k), jnp.float64)
    k = normal(rng, (B, S, G, d_k), jnp.float64)
    v = normal(rng, (B, S, G, d_v), jnp.float64)
    want_o, want_lse = _attention_f64(q, k, v, scale, None)
    want_window = _attention_f64(q, k, v, scale, 5)[0]
    for mla, routes in ((True, [("private", d_v)] * 2),
                        (False, [("private", d_k), ("public", d_k)])):
        calls.clear()
        o, lse = cudnn.causal_attention(q, k, v, scale, mla=mla)
        assert o.shape == (B, S, N, d_v) and lse.shape == (B, S, N)
        assert rel_err(o, want_o) <= 1e-12 and rel_err(lse, want_lse) <= 1e-12
        window = cudnn.window_attention(q, k, v, window=5, scale=scale, fa3=False, mla=mla)
        assert rel_err(window, want_window) <= 1e-12
        assert calls == routes

    def refusing(**kw):
        raise TypeError("unexpected keyword argument 'sliding_window_length'")

    monkeypatch.setattr(cudnn, "_cudnn_private", lambda: (refusing, MaskType))
    calls.clear()
    with pytest.warns(RuntimeWarning, match="v padded to d_k"):
        o, _ = cudnn.causal_attention(q, k, v, scale, mla=True)
    assert rel_err(o, want_o) <= 1e-12 and calls == [("public", d_k)]


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")
def test_gpu_cudnn_mla_form_matches_padded_v():
    """The paper's heads (d_k 192, d_v 128) on cuDNN with v unpadded against v padded to 192:
    the folded compressed branch (o, lse, gradients) and the window (o, gradients), bf16."""
    if not cudnn.cudnn_mla():
        pytest.skip("cuDNN < 9.10 or not a Hopper GPU: no MLA form")
    cfg = NSAConfig.tiny().replace(cmp_block=32, cmp_stride=16, sel_block=64)
    B, T, H, G, d_k, d_v = 1, 4096, 16, 2, 192, 128
    q, k_cmp, v_cmp = inputs(11, B, T, H, G, d_k, d_v, cfg, jnp.bfloat16)
    do = normal(np.random.default_rng(12), (B, T, H, d_v), jnp.bfloat16)
    scale = d_k ** -0.5
    l = cfg.cmp_block
    form = {mla: outputs_and_grads(lambda q, k, v: cudnn.compressed_attention(
        q, k, v, cfg, scale=scale,
        attend=lambda *a: cudnn.causal_attention(*a, mla=mla)), do, q, k_cmp, v_cmp)
        for mla in (True, False)}
    assert_close_bf16(after_first_block(form[True], l), after_first_block(form[False], l),
                      ("o", "lse", "dq", "dk", "dv"))
    k = k_cmp[:, :1].repeat(T, 1) + normal(np.random.default_rng(13), (B, T, G, d_k),
                                           jnp.bfloat16)
    v = normal(np.random.default_rng(14), (B, T, G, d_v), jnp.bfloat16)
    window = {mla: outputs_and_grads(
        lambda q, k, v: cudnn.window_attention(q, k, v, window=512, scale=scale, fa3=False,
                                               mla=mla), do, q, k, v)
              for mla in (True, False)}
    assert_close_bf16(window[True], window[False], ("o", "dq", "dk", "dv"))


@pytest.fixture
def fa3_f64(monkeypatch):
    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: (fa3_forward_f64, fa3_backward_f64))


def test_fa3_compressed_fold_matches_chunked_path(x64, fa3_f64):
    """The compressed fold on the FA-3 wrapper: o, lse (laid out `[B, T, H]`, no gradient) and
    gradients against the chunked XLA path."""
    cfg = NSAConfig.tiny().replace(cmp_block=8, cmp_stride=4)
    q, k_cmp, v_cmp = inputs(3, 2, 45, 4, 2, 8, 6, cfg, jnp.float64)
    do = normal(np.random.default_rng(4), (2, 45, 4, 6), jnp.float64)

    @functools.partial(jax.jit, static_argnums=0)
    def run(fn, q, k, v, do):
        (o, lse), pullback = jax.vjp(fn, q, k, v)
        return (o, lse, *pullback((do, jnp.ones_like(lse))))  # lse's cotangent goes nowhere

    got = run(lambda q, k, v: cudnn.compressed_attention(q, k, v, cfg, scale=0.3,
                                                          attend=cudnn.fa3_causal_attention),
              q, k_cmp, v_cmp, do)
    want = run(lambda q, k, v: xla_compressed_attention(
        q, k, v, cfg, scale=0.3, return_lse=True, options=XlaOptions(compressed_cudnn=False)),
        q, k_cmp, v_cmp, do)
    got_lse, want_lse = got[1][:, 7:], want[1][:, 7:]
    assert np.all(np.isneginf(got[1][:, :7]))
    assert rel_err(got_lse, want_lse) <= 1e-12
    want_no_lse_grad = outputs_and_grads(lambda q, k, v: xla_compressed_attention(
        q, k, v, cfg, scale=0.3, options=XlaOptions(compressed_cudnn=False)), do, q, k_cmp,
        v_cmp)[1:]
    for name, g, w in zip(("o", "dq", "dk", "dv"), (got[0], *got[2:]),
                          (want[0], *want_no_lse_grad)):
        assert rel_err(g, w) <= 1e-12, name


@pytest.mark.parametrize("T,w,d_v", [(40, 8, 8), (23, 30, 4)])
def test_fa3_window_matches_banded_path(x64, fa3_f64, T, w, d_v):
    """The window on the FA-3 wrapper (v zero-padded to d_k, a window longer than T) against
    the banded XLA path: output and gradients."""
    from nsa_jax.xla.sliding_window import sliding_window_attention

    rng = np.random.default_rng(T)
    q = normal(rng, (2, T, 4, 8), jnp.float64)
    k = normal(rng, (2, T, 2, 8), jnp.float64)
    v = normal(rng, (2, T, 2, d_v), jnp.float64)
    do = normal(rng, (2, T, 4, d_v), jnp.float64)

    got = outputs_and_grads(
        lambda q, k, v: cudnn.fa3_window_attention(q, k, v, window=w, scale=0.4), do, q, k, v)
    want = outputs_and_grads(lambda q, k, v: sliding_window_attention(
        q, k, v, window=w, scale=0.4, options=XlaOptions(window_cudnn=False)), do, q, k, v)
    for name, g, want_ in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == want_.shape, name
        assert rel_err(g, want_) <= 1e-12, name


def test_fa3_needs_the_package_and_a_hopper_gpu(monkeypatch):
    x = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: None)
    assert not cudnn.fa3_takes(x, x, x)
    assert cudnn.fused_causal(True, x, x, x) is cudnn.causal_attention
    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: (fa3_forward_f64, fa3_backward_f64))
    on_hopper = cudnn.takes(x, x, x) and cudnn.max_head_dim() == 256
    assert cudnn.fa3_takes(x, x, x) == on_hopper
    assert cudnn.fused_causal(False, x, x, x) is cudnn.causal_attention
    wide = jnp.zeros((1, 8, 2, 192), jnp.bfloat16)  # the build takes head sizes <= 128 only
    assert not cudnn.fa3_takes(wide, wide, wide)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("d_k,d_v", [(128, 128), (64, 32)])
def test_gpu_fa3_matches_cudnn(d_k, d_v):
    """FlashAttention-3 (where installed) against cuDNN: the folded compressed branch (o, lse,
    gradients) and the window, bf16, the layer's shapes."""
    q0 = jnp.zeros((1, 8, 2, d_k), jnp.bfloat16)
    if not cudnn.fa3_takes(q0, q0, q0):
        pytest.skip("flash_attn3_jax not installed, not a Hopper GPU, or d_k > 128")
    from nsa_jax.xla.sliding_window import sliding_window_attention

    cfg = NSAConfig.tiny().replace(cmp_block=32, cmp_stride=16, sel_block=64)
    B, T, H, G = 1, 4096, 16, 2
    q, k_cmp, v_cmp = inputs(7, B, T, H, G, d_k, d_v, cfg, jnp.bfloat16)
    do = normal(np.random.default_rng(8), (B, T, H, d_v), jnp.bfloat16)
    scale = d_k ** -0.5
    l = cfg.cmp_block
    got = outputs_and_grads(lambda q, k, v: cudnn.compressed_attention(
        q, k, v, cfg, scale=scale, attend=cudnn.fa3_causal_attention), do, q, k_cmp, v_cmp)
    want = outputs_and_grads(lambda q, k, v: cudnn.compressed_attention(
        q, k, v, cfg, scale=scale), do, q, k_cmp, v_cmp)
    assert np.all(np.isneginf(np.asarray(got[1][:, :l - 1])))
    assert_close_bf16(after_first_block(got, l), after_first_block(want, l),
                      ("o", "lse", "dq", "dk", "dv"))
    k, v = k_cmp[:, :1].repeat(T, 1), v_cmp[:, :1].repeat(T, 1)
    k = k + normal(np.random.default_rng(9), k.shape, k.dtype)
    v = v + normal(np.random.default_rng(10), v.shape, v.dtype)
    for w in (512, 100):
        got = outputs_and_grads(
            lambda q, k, v: cudnn.fa3_window_attention(q, k, v, window=w, scale=scale), do,
            q, k, v)
        want = outputs_and_grads(lambda q, k, v: sliding_window_attention(
            q, k, v, window=w, scale=scale, options=XlaOptions(fa3=False)), do, q, k, v)
        assert_close_bf16(got, want, ("o", "dq", "dk", "dv"))


def test_fused_takes_without_cudnn_kernel_needs_fa3(monkeypatch):
    """`fused_takes`: cuDNN's gate first; then FA-3 (asked for and taking the arrays) or cuDNN's
    own kernel where `cudnn_kernel` allows it; off, with FA-3 absent or off, nothing fused."""
    x = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    monkeypatch.setattr(cudnn, "takes", lambda q, k, v: True)
    monkeypatch.setattr(cudnn, "max_head_dim", lambda: 256)
    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: (fa3_forward_f64, fa3_backward_f64))
    assert cudnn.fused_takes(x, x, x, fa3=True, cudnn_kernel=False)
    assert not cudnn.fused_takes(x, x, x, fa3=False, cudnn_kernel=False)
    assert cudnn.fused_takes(x, x, x, fa3=False, cudnn_kernel=True)
    wide = jnp.zeros((1, 8, 2, 192), jnp.bfloat16)   # beyond this FA-3 build's head size
    assert not cudnn.fused_takes(wide, wide, wide, fa3=True, cudnn_kernel=False)
    assert cudnn.fused_takes(wide, wide, wide, fa3=True, cudnn_kernel=True)
    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: None)
    assert not cudnn.fused_takes(x, x, x, fa3=True, cudnn_kernel=False)
    monkeypatch.setattr(cudnn, "takes", lambda q, k, v: False)
    assert not cudnn.fused_takes(x, x, x, fa3=True, cudnn_kernel=True)


@pytest.mark.slow
def test_layer_on_the_fa3_paths_equals_the_chunked_layer(x64, monkeypatch):
    """The whole layer (non-finite guard, compressed fold, window, selection from the fold's
    lse), forward and gradients, with both fused branches on the FA-3 wrappers over float64
    stand-ins (cuDNN's gate opened on the CPU), against the layer with the fused paths off."""
    import nsa_jax
    from jax_inputs import make_inputs

    taken = open_fa3_paths(monkeypatch)
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 150, jnp.float64, seed=5)   # 10 blocks, n_sel 4
    off = {"xla": XlaOptions(window_cudnn=False, compressed_cudnn=False)}

    def run(options):
        def loss(params, x):
            return jnp.sum(jnp.sin(nsa_jax.nsa_attention(params, x, cfg, options=options)))
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    try:
        (got, got_grads), (want, want_grads) = run(None), run(off)
    finally:
        jax.clear_caches()  # no compiled program of the patched paths outlives the patches
    assert sorted(set(taken)) == [(-1, -1), (cfg.window - 1, 0)]
    assert rel_err(got, want) <= 1e-12
    # Some leaves' gradients are zero up to rounding (e.g. a bias every key of a softmax
    # shares): an absolute floor for those.
    for g, w in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-12)
