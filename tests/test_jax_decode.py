"""nsa_jax decode: prefill + decode_step against the full layer at every position, read counts,
compile-once, cache layout and errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from jax_inputs import AUX_FLOAT, make_inputs
from nsa_common.testing import rel_err
from nsa_common import NSAConfig, decode_read_bound
from nsa_jax.decode import decode_read_bound as jnp_decode_read_bound

TOL = 1e-10      # float64 decode against the float64 layer
F32_TOL = 1e-5   # the spec's float32 tolerance


def expected_reads(cfg, t, block_idx):
    """The spec's per-step counts; block_idx `[B, G, n_sel]` of the token at position t."""
    l, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    cmp = max(0, (t + 1 - l) // d + 1)
    sel = max(sum(min(l_sel, t - j * l_sel + 1) for j in row if j >= 0)
              for row in np.asarray(block_idx).reshape(-1, cfg.n_sel))
    win = min(cfg.window, t + 1)
    return dict(cmp=cmp, sel=sel, win=win, total=cmp + sel + win, bound=decode_read_bound(cfg, t))


def run_generation(params, x, cfg, max_len, prefix):
    """Prefill `prefix` tokens (none if 0), then decode the rest one by one through a jitted
    step. -> (y [B, T, D], aux per position, reads per position, number of step traces)."""
    B, T, _ = x.shape
    cache = nsa_jax.init_cache(cfg, B, max_len, x.dtype)
    outputs, auxes, reads_log = [], [], []
    if prefix:
        y, cache, aux = nsa_jax.prefill(params, x[:, :prefix], cfg, cache, return_aux=True)
        assert np.all(np.asarray(cache.lengths) == prefix)
        outputs.append(y)
        auxes.extend({k: v[:, t] for k, v in aux.items()} for t in range(prefix))
        reads_log.extend([None] * prefix)
    traces = []

    @jax.jit
    def step(params, x_t, cache):
        traces.append(1)  # runs only while tracing
        return nsa_jax.decode_step(params, x_t, cfg, cache, return_aux=True)

    for t in range(prefix, T):
        y_t, cache, reads, aux = step(params, x[:, t:t + 1], cache)
        assert np.all(np.asarray(cache.lengths) == t + 1)
        outputs.append(y_t)
        auxes.append({k: v[:, 0] for k, v in aux.items()})
        reads_log.append({k: int(np.max(v)) for k, v in reads.items()})
    return jnp.concatenate(outputs, axis=1), auxes, reads_log, len(traces)


@pytest.mark.parametrize("prefix", [5, 37])
def test_decode_matches_layer_at_every_position(x64, prefix):
    """B = 2, H = 4 > G = 2, 70 tokens: 16 compressed blocks, 5 selection blocks, a window of 16
    that wraps its ring buffer several times; prefill below l and past w."""
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 70, jnp.float64, seed=1)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, auxes, reads_log, traces = run_generation(params, x, cfg, max_len=72, prefix=prefix)
    assert traces == 1  # one compilation for the whole generation
    for t in range(x.shape[1]):
        assert rel_err(y[:, t], ref_y[:, t]) <= TOL, t
        np.testing.assert_array_equal(auxes[t]["block_idx"], ref_aux["block_idx"][:, t])
        for key in AUX_FLOAT:
            assert rel_err(auxes[t][key], ref_aux[key][:, t]) <= TOL, (t, key)
        if reads_log[t] is not None:
            assert reads_log[t] == expected_reads(cfg, t, ref_aux["block_idx"][:, t]), t
            assert reads_log[t]["total"] <= reads_log[t]["bound"]


def test_decode_from_empty_cache_float32_mean_shared_short_cache():
    """No prefill; compress="mean", no RoPE, shared K/V, and max_len < w (the window ring
    buffer shrinks to max_len)."""
    cfg = NSAConfig.tiny(compress="mean", rope_theta=None, shared_kv=True, window=40,
                         n_heads=8, n_kv_heads=2)
    params, x = make_inputs(cfg, 2, 30, jnp.float32, seed=2)
    cache = nsa_jax.init_cache(cfg, 2, 30, jnp.float32)
    assert cache.k_win.shape == (2, 30, 2, cfg.d_k)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y, auxes, reads_log, traces = run_generation(params, x, cfg, max_len=30, prefix=0)
    assert traces == 1
    assert rel_err(y, ref_y) <= F32_TOL
    for t in range(30):
        np.testing.assert_array_equal(auxes[t]["block_idx"], ref_aux["block_idx"][:, t])
        assert reads_log[t] == expected_reads(cfg, t, ref_aux["block_idx"][:, t])


def test_read_bound_formula():
    cfg = NSAConfig.paper()
    t = np.array([0, 1, 30, 31, 32, 46, 47, 48, 4095, 65535])
    got = np.asarray(jax.vmap(lambda t: jnp_decode_read_bound(cfg, t))(jnp.asarray(t)))
    np.testing.assert_array_equal(got, [decode_read_bound(cfg, int(s)) for s in t])
    assert got[-1] == 5631  # the paper's Table 4 (which rounds T/d up and prints 5,632)


def test_cache_layout():
    cfg = NSAConfig.tiny()  # G 2, d_k 16, d_v 8, l 8, d 4, w 16
    cache = nsa_jax.init_cache(cfg, 3, 50, jnp.bfloat16)
    shapes = {name: tuple(a.shape) for name, a in cache._asdict().items()}
    assert shapes == {"k_sel": (3, 50, 2, 16), "v_sel": (3, 50, 2, 8),
                      "k_win": (3, 16, 2, 16), "v_win": (3, 16, 2, 8),
                      "k_raw": (3, 8, 2, 16), "v_raw": (3, 8, 2, 8),
                      "k_cmp": (3, 11, 2, 16), "v_cmp": (3, 11, 2, 8), "lengths": (3,),
                      "overflow": (3,)}
    assert cache.k_sel.dtype == jnp.bfloat16 and cache.lengths.dtype == jnp.int32


def test_decode_errors_name_the_argument():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 12, jnp.float32)
    cache = nsa_jax.init_cache(cfg, 2, 10)
    cases = [
        (lambda: nsa_jax.prefill(params, x, cfg, cache), "max_len"),
        (lambda: nsa_jax.prefill(params, x[:1, :4], cfg, cache), "cache"),
        (lambda: nsa_jax.decode_step(params, x[:, :2], cfg, cache), "x_t"),
        (lambda: nsa_jax.decode_step(params, x[:, :1, :8], cfg, cache), "x"),
        (lambda: nsa_jax.decode_step(params, x[:, :1], cfg.replace(window=4), cache), "cache"),
        (lambda: nsa_jax.init_cache(cfg, 0, 10), "batch"),
        (lambda: nsa_jax.init_cache(cfg, 2, -1), "max_len"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
    with pytest.raises(ValueError, match="lengths"):
        nsa_jax.prefill(params, x[:, :4], cfg, cache, lengths=jnp.array([1, 5]))
    with pytest.raises(ValueError, match="lengths"):
        nsa_jax.prefill(params, x[:, :4], cfg, cache, lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="branches"):
        nsa_jax.decode.decode_step_branches(params, x[:, :1], cfg, cache, branches=("full",))


def ragged_generation(params, x_all, cfg, max_len, prompt, chunk, steps, backend,
                      prefill_backend="xla"):
    """Row b: a prompt of `prompt[b]` tokens (one ragged prefill on the empty cache), a chunk of
    `chunk[b]` more (chunked prefill on the non-empty cache), then `steps` decode steps, all
    taken from x_all[b] in order. -> (y [B, max_len, D] by position, reads per step, cache)."""
    B = x_all.shape[0]
    prompt, chunk = np.asarray(prompt), np.asarray(chunk)
    y_all = np.zeros(x_all.shape)
    cache = nsa_jax.init_cache(cfg, B, max_len, x_all.dtype)
    y, cache = nsa_jax.prefill(params, x_all[:, :prompt.max()], cfg, cache,
                               lengths=jnp.asarray(prompt), backend=prefill_backend)
    for b in range(B):
        y_all[b, :prompt[b]] = y[b, :prompt[b]]
    rows = np.stack([np.arange(chunk.max()) + prompt[b] for b in range(B)])
    x_chunk = jnp.take_along_axis(x_all, jnp.asarray(np.minimum(rows, max_len - 1))[..., None],
                                  axis=1)
    y, cache = nsa_jax.prefill(params, x_chunk, cfg, cache, lengths=jnp.asarray(chunk),
                               backend=prefill_backend)
    for b in range(B):
        y_all[b, prompt[b]:prompt[b] + chunk[b]] = y[b, :chunk[b]]
    step = jax.jit(lambda p, x_t, c: nsa_jax.decode_step(p, x_t, cfg, c, return_aux=True,
                                                         backend=backend),
                   donate_argnums=2)
    reads_log = []
    for _ in range(steps):
        t = np.asarray(cache.lengths)
        x_t = x_all[jnp.arange(B), jnp.asarray(t)][:, None]
        y_t, cache, reads, aux = step(params, x_t, cache)
        y_all[np.arange(B), t] = y_t[:, 0]
        reads_log.append((t, {k: np.asarray(v) for k, v in reads.items()},
                          np.asarray(aux["block_idx"][:, 0])))
    return y_all, reads_log, cache


def check_ragged(params, x_all, cfg, max_len, prompt, chunk, steps, backend, tol):
    """Every position t of every row b equals the full forward of that sequence's tokens
    `0..t` (the layer is causal and its rows independent, so one forward of x_all gives each
    sequence's own at every t < its length); the reads of every step are each sequence's own
    counts, within the formula."""
    y_all, reads_log, cache = ragged_generation(params, x_all, cfg, max_len, prompt, chunk,
                                                steps, backend)
    final = np.asarray(prompt) + np.asarray(chunk) + steps
    np.testing.assert_array_equal(cache.lengths, final)
    assert not np.any(cache.overflow)
    ref_y, ref_aux = nsa_jax.nsa_attention(params, x_all[:, :final.max()], cfg, return_aux=True)
    for b, n in enumerate(final):
        for t in range(n):
            assert rel_err(y_all[b, t], ref_y[b, t]) <= tol, (b, t)
        for t_row, reads, block_idx in reads_log:
            t = int(t_row[b])
            np.testing.assert_array_equal(block_idx[b], ref_aux["block_idx"][b, t])
            got = {k: int(v[b]) for k, v in reads.items()}
            assert got == expected_reads(cfg, t, block_idx[b:b + 1]), (b, t)
            assert got["total"] <= got["bound"]


def test_ragged_batch_matches_each_sequence_alone(x64):
    """Three sequences of different lengths (one with an empty prompt) prefill in one call,
    continue with a ragged chunk, then decode from their own positions."""
    cfg = NSAConfig.tiny()
    params, x_all = make_inputs(cfg, 3, 40, jnp.float64, seed=6)
    check_ragged(params, x_all, cfg, 40, prompt=[3, 0, 21], chunk=[9, 14, 2], steps=10,
                 backend="xla", tol=TOL)


def test_chunked_prefill_equals_one_shot(x64):
    """Prefill in chunks (1 token, across block and window boundaries, with a ragged chunk)
    leaves the same cache and outputs as one prefill of the whole prompt."""
    cfg = NSAConfig.tiny(compress="mean", window=12)
    params, x = make_inputs(cfg, 2, 33, jnp.float64, seed=7)
    one = nsa_jax.init_cache(cfg, 2, 40, x.dtype)
    y_one, one = nsa_jax.prefill(params, x, cfg, one)
    chunked = nsa_jax.init_cache(cfg, 2, 40, x.dtype)
    ys, start = [], 0
    for size in (7, 1, 13, 12):  # one compilation for the last three: padded to 13 tokens
        padded = jnp.pad(x[:, start:start + size], ((0, 0), (0, 13 - size), (0, 0)))
        y, chunked = nsa_jax.prefill(params, padded, cfg, chunked,
                                     lengths=jnp.full((2,), size, jnp.int32))
        np.testing.assert_array_equal(y[:, size:], 0)
        ys.append(y[:, :size])
        start += size
    assert rel_err(jnp.concatenate(ys, axis=1), y_one) <= TOL
    for name in nsa_jax.DecodeCache._fields:
        a, b = np.asarray(getattr(chunked, name)), np.asarray(getattr(one, name))
        if a.dtype == bool or np.issubdtype(a.dtype, np.integer):
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name)


def test_cache_full_raises_eagerly_and_flags_under_jit():
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 12, jnp.float32, seed=8)
    cache = nsa_jax.init_cache(cfg, 2, 10)
    with pytest.raises(ValueError, match="sequence 1"):
        nsa_jax.prefill(params, x[:, :11], cfg, cache, lengths=jnp.array([3, 11]))
    _, cache = nsa_jax.prefill(params, x[:, :10], cfg, cache, lengths=jnp.array([9, 10]))
    with pytest.raises(ValueError, match="sequence 1.*max_len 10"):
        nsa_jax.decode_step(params, x[:, 10:11], cfg, cache)
    with pytest.raises(ValueError, match="sequence 0"):
        nsa_jax.prefill(params, x[:, :2], cfg, cache, lengths=jnp.array([2, 0]))

    # Under jit: the full sequence is left untouched, gets NaN and its overflow flag; the
    # other one decodes normally (its output is the eager step's).
    eager_y, _, _ = nsa_jax.decode_step(params, x[:, 10:11], cfg,
                                        cache._replace(lengths=jnp.array([9, 9], jnp.int32)))
    step = jax.jit(lambda c, x_t: nsa_jax.decode_step(params, x_t, cfg, c))
    y, after, _ = step(cache, x[:, 10:11])
    assert np.all(np.isnan(y[1])) and rel_err(y[0], eager_y[0]) <= F32_TOL
    np.testing.assert_array_equal(after.lengths, [10, 10])
    np.testing.assert_array_equal(after.overflow, [False, True])
    for name in ("k_sel", "k_win", "k_raw", "k_cmp"):
        np.testing.assert_array_equal(getattr(after, name)[1], getattr(cache, name)[1])
    y, after, _ = step(after, x[:, 11:12])
    assert np.all(np.isnan(y)) and np.all(after.overflow)
    chunk = jax.jit(lambda c, x: nsa_jax.prefill(params, x, cfg, c, lengths=jnp.array([0, 1])))
    y, flagged = chunk(cache._replace(lengths=jnp.array([3, 10], jnp.int32)), x[:, :1])
    assert np.all(np.isnan(y[1])) and np.all(y[0] == 0)
    np.testing.assert_array_equal(flagged.overflow, [False, True])


def check_branch_steps(backend):
    """`decode_step_branches` with one branch is `decode_step` with the gates forced to it
    (the same output and cache), and another branch's step differs: the benchmark's breakdown
    times real work. With no branch, the output is the gated zero (the output projection of 0)."""
    from bench.bench_decode import force_gates

    cfg = NSAConfig(d_model=24, n_heads=4, n_kv_heads=2, d_k=8, d_v=6, cmp_block=8,
                    cmp_stride=4, sel_block=16, n_sel=3, window=12)
    params, x = make_inputs(cfg, 2, 46, jnp.float32, seed=10)
    _, cache = nsa_jax.prefill(params, x[:, :45], cfg, nsa_jax.init_cache(cfg, 2, 64),
                               lengths=jnp.array([45, 30]))
    x_t = x[:, 45:46]
    step = jax.jit(nsa_jax.decode.decode_step_branches,
                   static_argnames=("cfg", "branches", "backend"))
    for branch in ("cmp", "sel", "win"):
        forced = force_gates(params, cfg, branch)
        y_ref, cache_ref, reads_ref = nsa_jax.decode_step(forced, x_t, cfg, cache,
                                                          backend=backend)
        y, cache_new, _ = step(forced, x_t, cfg=cfg, cache=cache, branches=(branch,),
                               backend=backend)
        assert rel_err(y, y_ref) <= F32_TOL, branch
        for got, want in zip(cache_new, cache_ref):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        other = {"cmp": "win", "sel": "cmp", "win": "sel"}[branch]
        y_other, _, _ = step(forced, x_t, cfg=cfg, cache=cache, branches=(other,),
                             backend=backend)
        assert rel_err(y_other, y_ref) > 1e-3, branch
    y_none, _, _ = step(params, x_t, cfg=cfg, cache=cache, branches=(), backend=backend)
    np.testing.assert_allclose(y_none, 0, atol=1e-6)


def test_decode_step_branches_is_decode_step_with_forced_gates():
    check_branch_steps("xla")


@pytest.mark.parametrize("shared_kv", [False, True])
def test_prepared_params_project_in_one_gemm(shared_kv):
    """`prepare_decode_params` changes how a step projects (one GEMM, gate logits included), not
    what it computes."""
    cfg = NSAConfig.tiny(shared_kv=shared_kv)
    params, x = make_inputs(cfg, 2, 12, jnp.float32, seed=14)
    prepared = nsa_jax.decode.prepare_decode_params(params, cfg)
    positions = jnp.array([[3], [11]], jnp.int32)
    want = nsa_jax.layer.project(params, x[:, :1], cfg, positions)
    got = nsa_jax.decode._project_step(prepared, x[:, :1], cfg, positions)
    packed, gate = nsa_jax.decode.PACKED, nsa_jax.decode.GATE_LOGITS
    assert set(got) == set(want) | {"gate_logits", packed, gate}
    # The gate logits' place in the GEMM's output (what the Pallas combine kernel reads).
    fused, offset = got[gate]
    np.testing.assert_array_equal(fused[:, offset:offset + 3 * cfg.n_heads],
                                  got["gate_logits"][:, 0])
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # The packed form (what the Pallas append kernel reads): each key / value is the columns
    # its entry names, bit for bit.
    arrays, columns = got[packed]
    assert set(columns) == {k for k in want if k.startswith(("k_", "v_"))}
    for key, (src, off) in columns.items():
        width = got[key].shape[2] * got[key].shape[3]
        np.testing.assert_array_equal(arrays[src][..., off:off + width],
                                      got[key].reshape(got[key].shape[:2] + (width,)),
                                      err_msg=key)
    np.testing.assert_allclose(got["gate_logits"], x[:, :1] @ params["wg"], rtol=1e-5,
                               atol=1e-6)
    _, cache = nsa_jax.prefill(params, x[:, :11], cfg, nsa_jax.init_cache(cfg, 2, 16))
    y_plain, _, _, aux_plain = nsa_jax.decode_step(params, x[:, 11:12], cfg, cache,
                                                   return_aux=True)
    y_fused, _, _, aux_fused = nsa_jax.decode_step(prepared, x[:, 11:12], cfg, cache,
                                                   return_aux=True)
    assert rel_err(y_fused, y_plain) <= F32_TOL
    assert rel_err(aux_fused["gates"], aux_plain["gates"]) <= F32_TOL


@pytest.mark.slow
def test_decode_takes_every_backend_form(monkeypatch):
    """decode_step and a chunked prefill reach the backends only through the dispatch's decode
    entries, in the layer's forms: a sequence is tried in order for each entry (a backend may
    have some entries only, or refuse an input); a lone name that lacks one is an error."""
    dispatch = nsa_jax.dispatch
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    queries = []

    def refuses(*args, **kwargs):
        raise NotImplementedError("test backend refuses every input")

    def counting_window(q, *args, **kwargs):
        queries.append(q.shape[1])
        return dispatch.xla.decode_selected_window_attention(q, *args, **kwargs)

    nsa_jax.register_backend("decode_compressed_attention", "test-decode", refuses)
    nsa_jax.register_backend("decode_selected_window_attention", "test-decode", counting_window)
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 24, jnp.float32, seed=15)
    _, cache = nsa_jax.prefill(params, x[:, :20], cfg, nsa_jax.init_cache(cfg, 2, 24))
    y_ref, after_ref, _ = nsa_jax.decode_step(params, x[:, 20:21], cfg, cache)
    for backend in (("test-decode", "xla"), ["xla"]):
        y, after, _ = nsa_jax.decode_step(params, x[:, 20:21], cfg, cache, backend=backend)
        np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(after.lengths, after_ref.lengths)
    assert queries == [1]
    with pytest.raises(ValueError, match=r"no backend of \['test-decode'\]"):
        nsa_jax.decode_step(params, x[:, 20:21], cfg, cache, backend="test-decode")
    # A chunk on a non-empty cache: its 3 queries through the same entries.
    y_chunk_ref, _ = nsa_jax.prefill(params, x[:, 20:23], cfg, cache)
    y_chunk, _ = nsa_jax.prefill(params, x[:, 20:23], cfg, cache, backend=("test-decode", "xla"))
    np.testing.assert_allclose(y_chunk, y_chunk_ref, rtol=1e-6, atol=1e-6)
    assert queries == [1, 3]


def test_a_full_step_attends_through_one_entry(monkeypatch):
    """A step with the three branches calls `decode_attention` once (the entry a backend fuses),
    with the caller's forced blocks; a step with some branches, or a backend registered from
    outside for one of the two entries it replaces, does not."""
    dispatch = nsa_jax.dispatch
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    calls = []

    def counting(*args, block_idx=None, **kwargs):
        calls.append(block_idx)
        return dispatch.xla.decode_attention(*args, block_idx=block_idx, **kwargs)

    nsa_jax.register_backend("decode_attention", "test-fused", counting)
    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 2, 40, jnp.float32, seed=16)
    _, cache = nsa_jax.prefill(params, x[:, :36], cfg, nsa_jax.init_cache(cfg, 2, 40))
    backend = ("test-fused", "xla")
    y_ref, _, _, aux = nsa_jax.decode_step(params, x[:, 36:37], cfg, cache, return_aux=True)
    y, _, _ = nsa_jax.decode_step(params, x[:, 36:37], cfg, cache, backend=backend)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    assert len(calls) == 1 and calls[0] is None
    forced = jnp.where(aux["block_idx"] == 0, -1, aux["block_idx"])
    *_, aux_forced = nsa_jax.decode_step(params, x[:, 36:37], cfg, cache, backend=backend,
                                         block_idx=forced, return_aux=True)
    assert len(calls) == 2 and calls[1] is not None
    np.testing.assert_array_equal(aux_forced["block_idx"], forced)
    _, _, _, aux_gathered = nsa_jax.decode_step(params, x[:, 36:37], cfg, cache,
                                                block_idx=forced, return_aux=True)
    np.testing.assert_allclose(aux_forced["o_sel"], aux_gathered["o_sel"], rtol=1e-6, atol=1e-6)
    nsa_jax.decode.decode_step_branches(params, x[:, 36:37], cfg, cache, branches=("cmp", "sel"),
                                        backend=backend)
    assert len(calls) == 2
    def own_selection(*args, **kwargs):
        return dispatch.xla.decode_compressed_select(*args, **kwargs)

    nsa_jax.register_backend("decode_compressed_select", "test-fused", own_selection)
    nsa_jax.decode_step(params, x[:, 36:37], cfg, cache, backend=backend)
    assert len(calls) == 2
