"""`nsa_jax.selection_alignment_loss` against a float64 brute force with explicit T x T attention
(dense and sparse targets, packed sequences, the gradient by finite differences), where its
gradient goes, a case built so that the importance equals the target (KL 0), extreme inputs,
the option checks, the NNX method, the dense warm-up, and the layer's outputs left unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bruteforce as bf
import nsa_jax
from conftest import enable_x64
from jax_inputs import make_inputs
from nsa_common import NSAConfig, num_sel_blocks, overlap_weights
from nsa_jax import AlignmentOptions, selection_alignment_loss

# n_local 1 and n_sel 5 leave several candidate blocks at T 112 (7 selection blocks of 16).
CFG = NSAConfig.tiny(n_sel=5, n_local=1)
T = 112
CU_SEQLENS = [0, 45, 45, T]            # an empty sequence; lengths 45 and 67
RTOL_F64 = 1e-10

# l = d = l_sel, mean compression, one K/V projection, one head per group, no RoPE: with keys
# constant over each selection block, a block's attention mass is l_sel times the probability of
# its compressed key, so the importance equals the target on the complete (candidate) blocks.
EQUAL_CFG = NSAConfig(d_model=32, n_heads=2, n_kv_heads=2, d_k=8, d_v=8, cmp_block=16,
                      cmp_stride=16, sel_block=16, n_sel=4, n_init=1, n_local=1, window=16,
                      compress="mean", shared_kv=True, rope_theta=None)


# -- the float64 brute force ----------------------------------------------------------------------
def bf_alignment(params, x, cfg, mode="dense", block_idx=None, eps=1e-6, cu_seqlens=None,
                 target_params=None):
    """The objective as docs/API.md defines it, query by query. -> (mean kl, kl [B, T, G],
    counted [B, T, G], the selection [B, T, G, n_sel] or None), float64. block_idx (sparse): the
    selection; None runs the brute-force selection. target_params: the parameters of the target
    and the selection (default: params), held fixed when the gradient is checked."""
    if cu_seqlens is not None:
        parts = [bf_alignment(params, x[:, s:e], cfg, mode,
                              None if block_idx is None else block_idx[:, s:e], eps,
                              target_params=target_params)
                 for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]) if e > s]
        kl, counted = (np.concatenate([p[i] for p in parts], 1) for i in (1, 2))
        chosen = None if mode == "dense" else np.concatenate([p[3] for p in parts], 1)
        return kl[counted].sum() / max(1, counted.sum()), kl, counted, chosen
    params = bf.nest_params(params)
    fixed = params if target_params is None else bf.nest_params(target_params)
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    H, G, L = cfg.n_heads, cfg.n_kv_heads, cfg.sel_block
    h = H // G
    kv = lambda name: "shared" if cfg.shared_kv else name                     # noqa: E731
    q = (x @ np.float64(params["wq"])).reshape(B, T, H, cfg.d_k)
    q_fixed = (x @ np.float64(fixed["wq"])).reshape(B, T, H, cfg.d_k)
    k_sel = (x @ np.float64(fixed["wk"][kv("sel")])).reshape(B, T, G, cfg.d_k)
    k_raw = (x @ np.float64(params["wk"][kv("cmp")])).reshape(B, T, G, cfg.d_k)
    if cfg.rope_theta is not None:
        q, q_fixed, k_sel, k_raw = (bf.bf_rope(a, np.arange(T), cfg.rope_theta)
                                    for a in (q, q_fixed, k_sel, k_raw))
    k_cmp = bf.bf_compress(k_raw, params["cmp_k"] if cfg.compress == "mlp" else None, cfg)
    _, p_cmp = bf.bf_compressed_attention(q, k_cmp, k_cmp[..., :1], cfg)
    S = num_sel_blocks(cfg, T)
    score = p_cmp @ overlap_weights(cfg, k_cmp.shape[1], S).astype(np.float64)
    score = score.reshape(B, T, G, h, S).sum(3)                               # [B, T, G, S]
    if mode == "sparse" and block_idx is None:
        block_idx = bf.bf_select_blocks(q_fixed, k_cmp, cfg)
    key_block = np.arange(T) // L
    logits = np.einsum("bthd,bshd->bths", q_fixed, np.repeat(k_sel, h, axis=2)) / np.sqrt(cfg.d_k)
    kl, counted = np.zeros((B, T, G)), np.zeros((B, T, G), bool)
    for b in range(B):
        for t in range(T):
            last = t // L
            for g in range(G):
                attended = (list(range(last + 1)) if mode == "dense"
                            else [int(j) for j in block_idx[b, t, g] if j >= 0])
                cand = [j for j in attended if cfg.n_init <= j <= last - cfg.n_local]
                if not cand:
                    continue
                keys = np.isin(key_block, attended) & (np.arange(T) <= t)
                mass = np.zeros(S)
                for head in range(g * h, (g + 1) * h):
                    z = np.where(keys, logits[b, t, head], -np.inf)
                    prob = np.exp(z - z.max())
                    mass += np.bincount(key_block, prob / prob.sum(), minlength=S)
                target = mass[cand] / mass[cand].sum()
                s = score[b, t, g, cand]
                p = s / s.sum() if s.sum() > 0 else np.zeros(len(cand))
                p = (p + eps) / (1 + len(cand) * eps)
                kl[b, t, g] = np.sum(target * np.log(np.where(target > 0, target / p, 1.0)))
                counted[b, t, g] = True
    return kl[counted].sum() / max(1, counted.sum()), kl, counted, block_idx


def leaf_names(tree) -> list[str]:
    return [".".join(k.key for k in path) for path, _ in
            jax.tree_util.tree_flatten_with_path(tree)[0]]


def reached(cfg: NSAConfig, train_queries: bool) -> set:
    """The parameters the documented gradient reaches."""
    names = {f"wk.{'shared' if cfg.shared_kv else 'cmp'}"}
    if cfg.compress == "mlp":
        names |= {f"cmp_k.{w}" for w in ("pos", "w1", "b1", "w2", "b2")}
    return names | ({"wq"} if train_queries else set())


def loss_with_aux(x, cfg, alignment, cu_seqlens=None):
    return lambda p: selection_alignment_loss(p, x, cfg, alignment=alignment,
                                              cu_seqlens=cu_seqlens, return_aux=True)


# -- against the brute force, float64 -------------------------------------------------------------
# The dense case runs three query chunks (the last one padded) and three key tiles of three
# blocks (the last one padded); the packed sparse one three tiles of two of its five slots, the
# other one three query chunks (the importance from the compressed attention's lse). Compiles
# dominate the test's time, so the packed dense case checks the loss alone.
CASES = [pytest.param("dense", None, False, dict(q_chunk=40, kv_blocks=3), True, id="dense"),
         pytest.param("sparse", CU_SEQLENS, True, dict(kv_blocks=2), True,
                      id="sparse-packed-train_queries"),
         pytest.param("sparse", None, False, dict(q_chunk=40), True, id="sparse"),
         pytest.param("dense", CU_SEQLENS, False, dict(kv_blocks=3), False, id="dense-packed")]


@pytest.mark.parametrize("mode, cu_seqlens, train_queries, chunks, check_grad", CASES)
def test_matches_float64_bruteforce_and_its_gradient(mode, cu_seqlens, train_queries, chunks,
                                                     check_grad):
    with enable_x64():
        B = 2 if cu_seqlens is None else 1
        params, x = make_inputs(CFG, B, T, jnp.float64, seed=3)
        alignment = AlignmentOptions(mode=mode, train_queries=train_queries, **chunks)
        loss_fn = loss_with_aux(x, CFG, alignment, cu_seqlens)
        if check_grad:
            (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
        else:
            loss, aux = loss_fn(params)
    ref, kl, counted, chosen = bf_alignment(params, x, CFG, mode, cu_seqlens=cu_seqlens)
    np.testing.assert_array_equal(aux["counted"], counted)
    assert counted.any() and not counted.all()
    np.testing.assert_allclose(aux["kl"], np.where(counted, kl, aux["kl"]), rtol=RTOL_F64,
                               atol=1e-14)
    assert float(loss) == pytest.approx(ref, rel=RTOL_F64) and ref > 1e-3
    if not check_grad:
        return

    allowed = reached(CFG, train_queries)
    for name, g in zip(leaf_names(grads), jax.tree_util.tree_leaves(grads)):
        if name not in allowed:
            assert not np.any(np.asarray(g)), f"{name} got a gradient"
    for name in allowed - {"cmp_k.b2"}:   # b2 shifts every logit of a query alike: gradient 0
        leaf = dict(zip(leaf_names(grads), jax.tree_util.tree_leaves(grads)))[name]
        assert np.any(np.abs(np.asarray(leaf)) > 1e-6), f"{name} got no gradient"

    # The directional derivative along the reached parameters, by central differences.
    direction = random_direction(params, allowed, seed=0)
    step = 1e-6
    # The target and the selection held fixed, as the gradient holds them.
    moved = [bf_alignment(jax.tree_util.tree_map(lambda p, v: np.asarray(p) + sign * step * v,
                                                 params, direction), x, CFG, mode, chosen,
                          cu_seqlens=cu_seqlens, target_params=params)[0]
             for sign in (1, -1)]
    assert slope(grads, direction) == pytest.approx((moved[0] - moved[1]) / (2 * step),
                                                    rel=1e-6)


def random_direction(params, allowed: set, seed: int):
    """A random direction in parameter space along the leaves named in `allowed` only."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(params),
        [rng.standard_normal(p.shape) * (name in allowed)
         for name, p in zip(leaf_names(params), jax.tree_util.tree_leaves(params))])


def slope(grads, direction) -> float:
    """The derivative along `direction` that the gradient gives."""
    return sum(float(np.sum(np.asarray(g) * v)) for g, v in
               zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(direction)))


# -- subsampled queries ---------------------------------------------------------------------------
def _strided_mean(kl, counted, stride):
    """The brute force's mean KL over the counted pairs of the queries at stride - 1, 2 stride -
    1, ... (the positions `query_stride` keeps)."""
    keep = np.zeros(counted.shape[1], bool)
    keep[stride - 1::stride] = True
    chosen = counted & keep[None, :, None]
    return kl[chosen].sum() / max(1, chosen.sum()), chosen


@pytest.mark.parametrize("mode, cu_seqlens, backend", [
    pytest.param("sparse", None, "xla", id="sparse"),
    pytest.param("dense", CU_SEQLENS, "xla", id="dense-packed"),
    pytest.param("sparse", CU_SEQLENS, "pallas", id="sparse-packed-pallas")])
def test_query_stride_is_the_mean_over_the_kept_queries(mode, cu_seqlens, backend):
    """query_stride 3: the loss is the brute force's mean over the kept queries' counted pairs,
    the per-token outputs hold them (the other queries 0 / not counted), and the gradient is
    that mean's (central differences, the target and the selection held fixed)."""
    stride = 3
    with enable_x64():
        B = 2 if cu_seqlens is None else 1
        params, x = make_inputs(CFG, B, T, jnp.float64, seed=4)
        alignment = AlignmentOptions(mode=mode, q_chunk=16, kv_blocks=3, query_stride=stride)
        (loss, aux), grads = jax.jit(jax.value_and_grad(lambda p: selection_alignment_loss(
            p, x, CFG, alignment=alignment, cu_seqlens=cu_seqlens, backend=backend,
            return_aux=True), has_aux=True))(params)
    _, kl, counted, chosen = bf_alignment(params, x, CFG, mode, cu_seqlens=cu_seqlens)
    ref, kept = _strided_mean(kl, counted, stride)
    np.testing.assert_array_equal(aux["counted"], kept)
    assert kept.any() and not np.array_equal(kept, counted)
    np.testing.assert_allclose(aux["kl"], np.where(kept, kl, 0.0), rtol=RTOL_F64, atol=1e-14)
    assert float(loss) == pytest.approx(ref, rel=RTOL_F64) and ref > 1e-3

    direction = random_direction(params, reached(CFG, False), seed=1)
    step = 1e-6
    moved = [_strided_mean(*bf_alignment(
        jax.tree_util.tree_map(lambda p, v: np.asarray(p) + sign * step * v, params, direction),
        x, CFG, mode, chosen, cu_seqlens=cu_seqlens, target_params=params)[1:3], stride)[0]
        for sign in (1, -1)]
    assert slope(grads, direction) == pytest.approx((moved[0] - moved[1]) / (2 * step),
                                                    rel=1e-6)


def test_query_stride_longer_than_the_sequence_gives_zero():
    params, x = make_inputs(CFG, 1, 20, jnp.float32, seed=1)
    loss, aux = selection_alignment_loss(params, x, CFG, return_aux=True,
                                         alignment=AlignmentOptions(query_stride=32))
    assert float(loss) == 0.0 and not np.asarray(aux["counted"]).any()


# -- KL 0 where the importance is the target; extreme inputs --------------------------------------
@pytest.fixture(scope="module")
def equal_case():
    """EQUAL_CFG's parameters, x constant over each selection block, and the compiled loss."""
    params, _ = make_inputs(EQUAL_CFG, 2, 96, jnp.float32, seed=5)
    rng = np.random.default_rng(5)
    blocks = rng.standard_normal((2, 96 // EQUAL_CFG.sel_block, EQUAL_CFG.d_model))
    x_blocks = jnp.asarray(np.repeat(blocks, EQUAL_CFG.sel_block, axis=1), jnp.float32)
    loss = jax.jit(jax.value_and_grad(lambda p, x: selection_alignment_loss(
        p, x, EQUAL_CFG, return_aux=True), has_aux=True))
    return params, x_blocks, loss


def test_zero_when_the_importance_equals_the_target(equal_case):
    params, x_blocks, loss = equal_case
    (value, aux), _ = loss(params, x_blocks)
    assert np.asarray(aux["counted"]).any()
    assert abs(float(value)) < 1e-6
    # The same layer on tokens that vary inside the blocks: the two differ.
    x = jnp.asarray(np.random.default_rng(6).standard_normal(x_blocks.shape), jnp.float32)
    (value, aux), _ = loss(params, x)
    assert float(value) > 1e-3 and np.all(np.asarray(aux["kl"]) >= -1e-6)


@pytest.mark.parametrize("x_scale, weight_scale", [(1e4, 1.0), (1.0, 30.0), (1e3, 10.0)])
def test_finite_and_bounded_at_extreme_inputs(equal_case, x_scale, weight_scale):
    params, _, loss = equal_case
    x = jnp.asarray(x_scale * np.random.default_rng(7).standard_normal((2, 96, 32)), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: weight_scale * p, params)
    (value, aux), grads = loss(params, x)
    n_blocks = num_sel_blocks(EQUAL_CFG, 96)
    assert 0 <= float(value) <= np.log(1 / AlignmentOptions().eps + n_blocks)
    assert np.all(np.isfinite(np.asarray(aux["kl"])))
    for g in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(g)))


def test_sparse_finite_at_extreme_inputs(equal_case):
    """Sparse mode takes the normaliser from the compressed attention and the scores from its
    own products: at scores of 1e8 the two round differently, and the loss stays finite."""
    params, _, _ = equal_case
    x = jnp.asarray(1e4 * np.random.default_rng(7).standard_normal((2, 96, 32)), jnp.float32)
    (value, aux), grads = jax.jit(jax.value_and_grad(lambda p, x: selection_alignment_loss(
        p, x, EQUAL_CFG, alignment=AlignmentOptions(mode="sparse"), return_aux=True),
        has_aux=True))(params, x)
    assert np.asarray(aux["counted"]).any()
    assert 0 <= float(value) <= np.log(1 / AlignmentOptions().eps + EQUAL_CFG.n_sel)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(g)))


# -- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("mode", "full"), ("train_queries", 1), ("eps", 0.0),
                                          ("eps", 0.5), ("q_chunk", 0), ("kv_blocks", 2.0),
                                          ("query_stride", 0)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AlignmentOptions(**{field: value})


def test_bad_arguments_name_the_argument():
    params, x = make_inputs(CFG, 1, 32, jnp.float32)
    with pytest.raises(ValueError, match="alignment"):
        selection_alignment_loss(params, x, CFG, alignment={"mode": "dense"})
    with pytest.raises(ValueError, match="block_idx"):
        selection_alignment_loss(params, x, CFG, block_idx=jnp.zeros((1, 32, 2, 5), jnp.int32))
    with pytest.raises(ValueError, match="block_idx"):
        selection_alignment_loss(params, x, CFG, alignment=AlignmentOptions(mode="sparse"),
                                 block_idx=jnp.zeros((1, 32, 2, 3), jnp.int32))
    with pytest.raises(ValueError, match="x has width"):
        selection_alignment_loss(params, x[..., :8], CFG)
    with pytest.raises(ValueError, match="cu_seqlens"):
        selection_alignment_loss(params, jnp.concatenate([x, x]), CFG, cu_seqlens=[0, 16, 32])
    with pytest.raises(ValueError, match="seq_len"):
        nsa_jax.dense_warmup_config(CFG, 0)


def test_dense_warmup_config_covers_every_block():
    assert nsa_jax.dense_warmup_config(CFG, T).n_sel == 7
    assert nsa_jax.dense_warmup_config(CFG, 20) == CFG        # n_sel already covers 2 blocks
    assert nsa_jax.dense_warmup_config(CFG, T).replace(n_sel=CFG.n_sel) == CFG


# -- the module, the dense warm-up, the layer left alone ------------------------------------------
def test_module_method_warmup_and_unchanged_layer(equal_case):
    """`NSAAttention.alignment_loss` is the functional loss; `dense_selection=True` selects every
    eligible block, so the selected branch is full causal attention; computing the loss and its
    gradient changes neither the layer's forward nor its decode."""
    pytest.importorskip("flax.nnx")
    from nsa_jax.nnx import NSAAttention

    params, _, loss = equal_case
    cfg, (B, T_eq) = EQUAL_CFG, (2, 96)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((B, T_eq, cfg.d_model)),
                    jnp.float32)
    module = NSAAttention.from_params(params, cfg)

    def outputs():
        y, aux = module(x, dense_selection=True, return_aux=True)
        module.init_cache(B, 3)
        return y, aux, [module.decode_step(x[:, i:i + 1]) for i in range(3)]

    before = outputs()
    value = module.alignment_loss(x)
    assert float(value) == float(selection_alignment_loss(params, x, cfg)) and value > 0
    jax.block_until_ready(loss(params, x))     # the objective's gradient too, then the layer
    jax.tree_util.tree_map(np.testing.assert_array_equal, outputs(), before)

    _, aux, _ = before
    idx = np.asarray(aux["block_idx"])
    assert idx.shape[-1] == num_sel_blocks(cfg, T_eq)
    last = np.arange(T_eq) // cfg.sel_block
    assert np.all((idx >= 0).sum(-1) == (last + 1)[None, :, None])
    xs = np.asarray(x, np.float64)
    q = (xs @ np.asarray(params["wq"], np.float64)).reshape(B, T_eq, cfg.n_heads, cfg.d_k)
    k = (xs @ np.asarray(params["wk"]["shared"], np.float64)).reshape(B, T_eq, 2, cfg.d_k)
    v = (xs @ np.asarray(params["wv"]["shared"], np.float64)).reshape(B, T_eq, 2, cfg.d_v)
    full = bf.bf_sliding_window_attention(q, k, v, window=T_eq)          # causal, every key
    np.testing.assert_allclose(aux["o_sel"], full, rtol=1e-4, atol=1e-5)


# -- the example ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_aligned_example_runs(capsys):
    from examples import train_aligned

    rows = train_aligned.main(["--preset", "smoke", "--steps", "3", "--dense_steps", "1",
                               "--eval_every", "3", "--eval_batch", "8", "--gen_tokens", "0"])
    assert [r["stage"] for r in rows] == ["sparse"] and rows[0]["step"] == 3
    assert np.isfinite(rows[0]["kl"]) and rows[0]["kl"] >= 0
    assert "l0_hit" in rows[0] and "kl" in capsys.readouterr().out
