"""CPU smoke of examples/train_recall.py: the data puts every key beyond the window, the window
baseline is NSA's window, and a tiny run trains (loss falls where it trivially can), writes its
outputs and generates through the decode cache exactly what teacher forcing predicts. And
examples/compare_recall.py: it plots several runs and names a bad argument."""
import csv
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from examples import train_recall
from nsa_common import NSAConfig


RTOL = 1e-5  # float32 on CPU: decode against the full forward, window attention paths


def test_batches_hide_every_key_beyond_the_window():
    cfg = NSAConfig.tiny(window=32)
    vocab = train_recall.Vocab()
    task = train_recall.Task("mqar", n_pairs=6, n_queries=4)
    T = 160
    batch = train_recall.make_batch(np.random.default_rng(0), task, vocab, 32, T, cfg)
    tokens, answers, key_pos = batch["tokens"], batch["answers"], batch["key_pos"]
    rows = np.arange(32)[:, None]
    first_query = T - task.tail
    queried_keys = tokens[:, first_query::2]
    assert np.array_equal(tokens[rows, key_pos], queried_keys)
    assert np.array_equal(tokens[rows, key_pos + 1], answers)
    assert np.array_equal(tokens[:, first_query + 1::2], answers)
    # The value (the token after the key) lies outside every query's window and forced blocks.
    assert (first_query - (key_pos + 1) >= cfg.window).all()
    assert (key_pos >= cfg.n_init * cfg.sel_block).all()
    assert ((key_pos + 1) // cfg.sel_block
            < first_query // cfg.sel_block - cfg.n_local + 1).all()
    # Each key occurs once in the context: the lookup is unambiguous.
    context = tokens[:, :first_query]
    for b in range(32):
        for key in queried_keys[b]:
            assert (context[b] == key).sum() == 1


def test_token_shift_mixes_each_channel_with_the_previous_token_and_keeps_causality():
    cfg = NSAConfig.tiny(d_v=16)
    mc = train_recall.ModelConfig("full", cfg, vocab_size=40, token_shift=True)
    params = train_recall.init_model(jax.random.PRNGKey(0), mc)
    blk = params["blocks"][0]
    mix = np.asarray(blk["shift_mix"], np.float64)
    assert mix[0] == 0.0 and mix[-1] == 1.0  # the ramp: from this token's to the previous one's
    h = jax.random.normal(jax.random.PRNGKey(1), (2, 24, cfg.d_model))
    a = np.asarray(train_recall.rms_norm(h, blk["norm1"]), np.float64)
    prev = np.concatenate([np.zeros_like(a[:, :1]), a[:, :-1]], axis=1)
    np.testing.assert_allclose(train_recall.attention_input(blk, h), (1 - mix) * a + mix * prev,
                               rtol=RTOL, atol=RTOL)
    # A later token changes no earlier position's output.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (1, 24)), jnp.int32)
    out = train_recall.forward(params, tokens, mc)
    changed = train_recall.forward(params, tokens.at[0, 15].set((tokens[0, 15] + 1) % 40), mc)
    np.testing.assert_allclose(out[:, :15], changed[:, :15], rtol=RTOL, atol=RTOL)
    assert not np.allclose(out[:, 15], changed[:, 15])
    # Without the shift the layer reads the normed input, and generation refuses the shift.
    plain = {k: v for k, v in blk.items() if k != "shift_mix"}
    np.testing.assert_allclose(train_recall.attention_input(plain, h), a, rtol=RTOL, atol=RTOL)
    with pytest.raises(ValueError, match="token shift"):
        train_recall.generate(params, tokens[:, :8], 2, mc, "xla")


def test_window_baseline_is_nsa_window_branch():
    cfg = NSAConfig.tiny(d_v=16)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (2, 48, cfg.n_heads, cfg.d_k))
    k = jax.random.normal(kk, (2, 48, cfg.n_kv_heads, cfg.d_k))
    v = jax.random.normal(kv, (2, 48, cfg.n_kv_heads, cfg.d_v))
    ours = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        local_window_size=(cfg.window - 1, 0))
    ref = nsa_jax.sliding_window_attention(q, k, v, window=cfg.window)
    np.testing.assert_allclose(ours, ref, rtol=RTOL, atol=RTOL)


def test_lr_multipliers_pick_the_compression_path():
    cfg = NSAConfig.tiny()
    mc = train_recall.ModelConfig("nsa", cfg, vocab_size=20, n_layers=1)
    variant = train_recall.VARIANTS["cmp_lr10"]
    params = train_recall.init_model(jax.random.PRNGKey(0), mc, variant)
    mults = train_recall.lr_multipliers(params, variant)
    attn = mults["blocks"][0]["attn"]
    boosted = [attn["wk"]["cmp"], attn["wv"]["cmp"], *attn["cmp_k"].values(),
               *attn["cmp_v"].values()]
    assert all(float(m) == variant.cmp_lr_mult for m in boosted)
    plain = [attn["wq"], attn["wk"]["sel"], attn["wv"]["win"], attn["wg"], mults["embed"]]
    assert all(float(m) == 1.0 for m in plain)


def test_gate_bias_variant_sets_the_sel_gate():
    cfg = NSAConfig.tiny()
    mc = train_recall.ModelConfig("nsa", cfg, vocab_size=20, n_layers=1)
    params = train_recall.init_model(jax.random.PRNGKey(0), mc, train_recall.VARIANTS["sel_gate"])
    bg = np.asarray(params["blocks"][0]["attn"]["bg"]).reshape(cfg.n_heads, 3)
    np.testing.assert_array_equal(bg, np.tile([0.0, 2.0, 0.0], (cfg.n_heads, 1)))
    assert train_recall.VARIANTS["sel_only"].gate_bias == (-4.0, 4.0, -4.0)


CHUNK_TASKS = [train_recall.Task("needle", 1, 1), train_recall.Task("mqar", n_pairs=3, n_queries=3)]


def _chunked_eval_case(task):
    """A one-layer model and a 3-row eval batch (chunks of 2 rows leave an uneven last chunk of
    one): -> (model config, params, [tokens, answers, key_pos])."""
    cfg = NSAConfig.tiny(window=32)
    mc = train_recall.ModelConfig("nsa", cfg, vocab_size=train_recall.Vocab().size, n_layers=1)
    params = train_recall.init_model(jax.random.PRNGKey(1), mc, train_recall.VARIANTS["default"])
    batch = train_recall.make_batch(np.random.default_rng(0), task, train_recall.Vocab(), 3, 160,
                                    cfg)
    return mc, params, [jnp.asarray(batch[k]) for k in ("tokens", "answers", "key_pos")]


def _assert_chunks_match(fn, reference, params, arrays, *, mc, task):
    chunked = train_recall.in_chunks(functools.partial(fn, params, mc=mc, task=task), arrays, 2)
    assert chunked.keys() == reference.keys()
    for k in reference:
        assert chunked[k] == pytest.approx(reference[k], rel=RTOL, abs=RTOL), k


@pytest.mark.parametrize("task", CHUNK_TASKS)
def test_eval_in_chunks_equals_one_call(task):
    """The eval batch in chunks (--eval_chunk; an H100 ran out of memory on 256 rows at once)
    gives the one-call statistics, an uneven last chunk included."""
    mc, params, arrays = _chunked_eval_case(task)
    whole = {k: float(v) for k, v in
             train_recall.evaluate(params, *arrays, mc=mc, task=task).items()}
    _assert_chunks_match(train_recall.evaluate, whole, params, arrays, mc=mc, task=task)
    with pytest.raises(ValueError, match="eval_chunk"):
        train_recall.in_chunks(train_recall.evaluate, arrays, 0)


@pytest.mark.slow
def test_ablation_in_chunks_equals_one_call():
    """The same for `ablation_accuracy`, on the MQAR task (the chunking does not depend on the
    task; test_eval_in_chunks_equals_one_call covers both). Slow: each ablation registers its
    backend again, which recompiles the layer (six ablations per call, three calls)."""
    task = CHUNK_TASKS[1]
    mc, params, arrays = _chunked_eval_case(task)
    whole = train_recall.ablation_accuracy(params, *arrays, mc=mc, task=task)
    _assert_chunks_match(train_recall.ablation_accuracy, whole, params, arrays, mc=mc, task=task)


def _tiny_mqar(attention: str, cfg: NSAConfig, *, n_pairs: int, batch: int, seed: int):
    """A T 128 MQAR batch over a 40-token vocabulary and a fresh model of `attention`:
    -> (task, model config, params, batch: the `make_batch` dict as jax arrays)."""
    vocab = train_recall.Vocab(n_filler=16, n_keys=16, n_values=8)
    task = train_recall.Task("mqar", n_pairs=n_pairs, n_queries=n_pairs)
    mc = train_recall.ModelConfig(attention, cfg, vocab.size)
    params = train_recall.init_model(jax.random.PRNGKey(seed), mc)
    data = train_recall.make_batch(np.random.default_rng(0), task, vocab, batch, 128, cfg)
    return task, mc, params, {k: jnp.asarray(v) for k, v in data.items()}


@pytest.mark.slow
def test_pooled_ranking_probe_is_nsa_selection_over_the_full_models_keys():
    """The full model's probe (`pooled_ranking`) at layer 0 picks what NSA's own selection picks
    in a `mean_shared` layer holding the same wq / wk (`nsa_from_dense`; layer 0's input is the
    same embedding), for both pools; key_mass is the full model's attention on the key's
    selection block, against a float64 numpy softmax."""
    cfg = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, cmp_block=16,
                    cmp_stride=8, sel_block=16, n_sel=5, window=16, rope_theta=10000.0)
    task, full, p_full, batch = _tiny_mqar("full", cfg, n_pairs=3, batch=6, seed=2)
    tokens, key_pos = batch["tokens"], batch["key_pos"]
    q_pos = np.arange(128 - task.tail, 128, 2)
    a = train_recall.forward(p_full, tokens, full, collect=True)[1][0][0]
    attn = p_full["blocks"][0]["attn"]
    probe = train_recall.pooled_ranking(attn, a, q_pos, key_pos, cfg)
    key_block = np.asarray(key_pos) // cfg.sel_block
    for name, pool in train_recall.PROBE_POOLS:
        pooled = cfg.replace(**({} if pool is None else
                                {"cmp_block": pool[0], "cmp_stride": pool[1]}))
        variant = train_recall.VARIANTS["mean_shared"]
        nsa = train_recall.ModelConfig("nsa", train_recall.variant_cfg(pooled, variant),
                                       full.vocab_size)
        p_nsa = train_recall.nsa_from_dense(p_full, train_recall.init_model(
            jax.random.PRNGKey(5), nsa, variant))
        a_nsa, aux = train_recall.forward(p_nsa, tokens, nsa, collect=True)[1][0]
        np.testing.assert_array_equal(a_nsa, a)
        idx = np.asarray(aux["block_idx"])[:, q_pos]                            # [B, Q, G, n]
        hit = (idx == key_block[:, :, None, None]).any(-1).mean()
        assert float(probe[f"{name}_hit"]) == pytest.approx(hit, abs=1e-6), name
    # key_mass in float64: query head h reads KV head h // (H / G)
    B, T, H, G, dk = 6, 128, cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    positions = jnp.arange(T, dtype=jnp.int32)
    q = np.asarray(nsa_jax.apply_rope((a @ attn["wq"]).reshape(B, T, H, dk), positions,
                                      cfg.rope_theta), np.float64)
    k = np.asarray(nsa_jax.apply_rope((a @ attn["wk"]).reshape(B, T, G, dk), positions,
                                      cfg.rope_theta), np.float64)
    masses = []
    for b in range(B):
        for j, t in enumerate(q_pos):
            for h in range(H):
                s = k[b, :t + 1, h // (H // G)] @ q[b, t, h] / np.sqrt(dk)
                p = np.exp(s - s.max())
                p /= p.sum()
                masses.append(p[np.arange(t + 1) // cfg.sel_block == key_block[b, j]].sum())
    assert float(probe["key_mass"]) == pytest.approx(np.mean(masses), rel=1e-5)
    assert 0.0 < float(probe["key_mass"]) < 1.0


@pytest.mark.slow
def test_smoke_run_learns_and_decodes(tmp_path):
    # n_values 4: the answer's distribution alone takes the loss from ~log(vocab) = 5.0 toward
    # log(4) = 1.4, which a few steps learn without any recall.
    summaries = train_recall.main([
        "--preset", "smoke", "--tasks", "needle", "--models", "nsa", "--n_values", "4",
        "--steps", "8", "--eval_every", "4", "--gen_tokens", "3", "--gen_batch", "4",
        "--budget_s", "1e5", "--out", str(tmp_path)])
    for name in ("curves.csv", "summary.csv", "results.md", "curves.png", "stats.json"):
        assert os.path.getsize(tmp_path / name) > 0, name
    with open(tmp_path / "curves.csv", newline="") as f:
        curve = list(csv.DictReader(f))
    assert [int(r["step"]) for r in curve] == [1, 5, 8]
    first, last = float(curve[0]["eval_loss"]), float(curve[-1]["eval_loss"])
    assert math.isfinite(last) and last < first - 1.0, (first, last)
    for key in ("l0_gate_cmp", "l0_gate_sel", "l0_gate_win", "l0_hit", "l0_cmp_mass"):
        assert 0.0 <= float(curve[-1][key]) <= 1.0, key
    (summary,) = summaries
    assert summary["gen_match"] == 1.0
    assert summary["gen_logit_err"] < RTOL
    with open(tmp_path / "stats.json") as f:
        assert json.load(f)["summaries"][0]["model"] == "nsa:default"


def test_variants_change_the_nsa_config():
    cfg = NSAConfig.tiny()
    assert train_recall.variant_cfg(cfg, train_recall.VARIANTS["default"]) == cfg
    assert train_recall.variant_cfg(cfg, train_recall.VARIANTS["nsel_x2"]).n_sel == 2 * cfg.n_sel
    assert train_recall.variant_cfg(cfg, train_recall.VARIANTS["mean_cmp"]).compress == "mean"
    shared = train_recall.variant_cfg(cfg, train_recall.VARIANTS["shared_kv"])
    assert shared.shared_kv and shared.compress == "mlp"
    mean_shared = train_recall.variant_cfg(cfg, train_recall.VARIANTS["mean_shared"])
    assert mean_shared.shared_kv and mean_shared.compress == "mean"
    mc = train_recall.ModelConfig("nsa", mean_shared, vocab_size=20, n_layers=1)
    params = train_recall.init_model(jax.random.PRNGKey(0), mc,
                                     train_recall.VARIANTS["mean_shared"])
    assert set(params["blocks"][0]["attn"]["wk"]) == {"shared"}
    assert "cmp_k" not in params["blocks"][0]["attn"]
    # sel_only's gates on the mean_shared layer
    variant = train_recall.VARIANTS["sel_mean_shared"]
    assert train_recall.variant_cfg(cfg, variant) == mean_shared
    params = train_recall.init_model(jax.random.PRNGKey(0), mc, variant)
    assert set(params["blocks"][0]["attn"]["wk"]) == {"shared"}
    bg = np.asarray(params["blocks"][0]["attn"]["bg"]).reshape(cfg.n_heads, 3)
    np.testing.assert_array_equal(bg, np.tile([-4.0, 4.0, -4.0], (cfg.n_heads, 1)))
    # mean_shared with its gates held at 0.5: wg 0, and neither wg nor bg is updated
    variant = train_recall.VARIANTS["mean_shared_fixed"]
    assert train_recall.variant_cfg(cfg, variant) == mean_shared
    params = train_recall.init_model(jax.random.PRNGKey(0), mc, variant)
    attn = params["blocks"][0]["attn"]
    assert not np.any(np.asarray(attn["wg"])) and not np.any(np.asarray(attn["bg"]))
    mults = train_recall.lr_multipliers(params, variant)["blocks"][0]["attn"]
    assert float(mults["wg"]) == float(mults["bg"]) == 0.0 and float(mults["wk"]["shared"]) == 1.0
    cmp_sel = train_recall.VARIANTS["cmp_sel_shared"]
    assert train_recall.variant_cfg(cfg, cmp_sel).shared_kv
    mc = train_recall.ModelConfig("nsa", train_recall.variant_cfg(cfg, cmp_sel), vocab_size=20,
                                  n_layers=1)
    bg = train_recall.init_model(jax.random.PRNGKey(0), mc, cmp_sel)["blocks"][0]["attn"]["bg"]
    np.testing.assert_allclose(np.asarray(bg).reshape(-1, 3)[0], [4.0, 4.0, -4.0])


def test_shift_places_keys_in_their_selection_block():
    cfg = NSAConfig.tiny(window=32)
    vocab = train_recall.Vocab()
    task = train_recall.Task("mqar", n_pairs=3, n_queries=3)
    T = 256
    for shift, offset in (("half", cfg.sel_block // 2), ("edge", cfg.sel_block - 2)):
        batch = train_recall.make_batch(np.random.default_rng(0), task, vocab, 16, T, cfg, shift)
        key_pos = batch["key_pos"]
        assert (key_pos % cfg.sel_block == offset).all(), shift
        # Still beyond the window and the forced blocks, the value in the key's block.
        first_query = T - task.tail
        assert (first_query - (key_pos + 1) >= cfg.window).all()
        assert ((key_pos + 1) // cfg.sel_block == key_pos // cfg.sel_block).all()
        assert (key_pos >= cfg.n_init * cfg.sel_block).all()
    # "none" draws exactly the batches it drew before the option existed.
    old = train_recall.make_batch(np.random.default_rng(1), task, vocab, 4, T, cfg)
    lo, hi = train_recall.pair_region(task, T, cfg)
    rng = np.random.default_rng(1)
    rng.integers(0, vocab.n_filler, (4, T))
    slots = np.argsort(rng.random((4, (hi - lo) // 2)), axis=1)[:, :task.n_pairs]
    np.testing.assert_array_equal(np.sort(old["key_pos"], 1), np.sort(lo + 2 * slots, 1))


def test_curriculum_stages():
    stages = train_recall.parse_curriculum("512:400,1024:800", 1200)
    assert stages == [(512, 400), (1024, 800)]
    assert [train_recall.length_at(s, stages, 2048) for s in (0, 399, 400, 799, 800, 1199)] == [
        512, 512, 1024, 1024, 2048, 2048]
    assert train_recall.parse_curriculum("", 10) == []
    for bad in ("512", "512:400,1024:300", "512:2000"):
        try:
            train_recall.parse_curriculum(bad, 1200)
        except ValueError:
            continue
        raise AssertionError(bad)
    # The preset's curriculum follows other --steps / --T (the runner's showcase: T 1024, 400).
    args = train_recall.parse_args(["--out", "x", "--T", "1024", "--steps", "400"])
    assert args.curriculum == "512:133"
    assert train_recall.parse_args(["--out", "x"]).curriculum == "512:400,1024:800"
    assert train_recall.parse_args(["--out", "x", "--curriculum", ""]).curriculum == ""


@pytest.mark.slow
def test_smoke_curriculum_no_rope_shift_all_models(tmp_path):
    # Curriculum (T 64 for 2 steps, then 128), RoPE off, keys mid-block, the three models and a
    # shared-K/V NSA: every run trains and the NSA one records its gradient norms.
    summaries = train_recall.main([
        "--preset", "smoke", "--tasks", "needle", "--models", "full,window,nsa",
        "--variants", "mean_shared", "--steps", "4", "--eval_every", "2", "--curriculum",
        "64:2", "--rope_theta", "0", "--shift", "half", "--gen_tokens", "2", "--gen_batch", "2",
        "--budget_s", "1e5", "--out", str(tmp_path)])
    assert [s["model"] for s in summaries] == ["full", "window", "nsa:mean_shared"]
    assert all(s["steps"] == 4 and math.isfinite(s["final_loss"]) for s in summaries)
    assert summaries[-1]["gen_match"] == 1.0
    with open(tmp_path / "curves.csv", newline="") as f:
        curve = [r for r in csv.DictReader(f) if r["model"] == "nsa:mean_shared"]
    assert [int(r["T"]) for r in curve] == [64, 128, 128]
    assert float(curve[-1]["l0_gk_shared"]) > 0.0
    with open(tmp_path / "stats.json") as f:
        assert json.load(f)["runs"][-1]["nsa"]["rope_theta"] is None


@pytest.mark.slow
def test_nsa_selecting_everything_with_gates_0_1_0_is_the_full_model():
    # n_sel covers all 8 selection blocks of T 128 and the gates are fixed at (0, 1, 0)
    # (sigmoid(+-30)): the selected branch is causal attention over every token, so with the
    # full model's weights (`dense_init`) NSA's logits and the gradients of the shared
    # parameters must be the full model's: NSA's slower escape from the MQAR plateau is not a
    # wrong layer.
    cfg = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, cmp_block=8,
                    cmp_stride=4, sel_block=16, n_sel=8, window=16, rope_theta=10000.0)
    vocab = train_recall.Vocab(n_filler=16, n_keys=16, n_values=8)
    task = train_recall.Task("mqar", n_pairs=4, n_queries=4)
    variant = train_recall.VARIANTS["sel_fixed_dense"]
    full = train_recall.ModelConfig("full", cfg, vocab.size)
    nsa = train_recall.ModelConfig("nsa", cfg, vocab.size)
    key = jax.random.PRNGKey(3)
    p_full, p_nsa = train_recall.init_model(key, full), train_recall.init_model(key, nsa, variant)
    batch = train_recall.make_batch(np.random.default_rng(0), task, vocab, 3, 128, cfg)
    tokens, answers = jnp.asarray(batch["tokens"]), jnp.asarray(batch["answers"])
    logits = [train_recall.logits_at(p, train_recall.forward(p, tokens, mc))
              for p, mc in ((p_full, full), (p_nsa, nsa))]
    np.testing.assert_allclose(logits[1], logits[0], rtol=RTOL, atol=RTOL)

    def grads(p, mc):
        return jax.grad(lambda p: train_recall.loss_and_accuracy(p, tokens, answers, mc,
                                                                  task)[0])(p)

    g_full, g_nsa = grads(p_full, full), grads(p_nsa, nsa)
    # The NSA gradients of the parameters both models have, in the full model's layout.
    shared = dict(g_nsa, blocks=[
        dict(b, attn={"wq": b["attn"]["wq"], "wk": b["attn"]["wk"]["sel"],
                      "wv": b["attn"]["wv"]["sel"], "wo": b["attn"]["wo"]})
        for b in g_nsa["blocks"]])
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(g_full))
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale), shared, g_full)
    # The unused branches and the fixed gates get (next to) no gradient, and no update.
    attn = g_nsa["blocks"][0]["attn"]
    assert float(jnp.max(jnp.abs(attn["wk"]["cmp"]))) < 1e-10 * scale
    mults = train_recall.lr_multipliers(p_nsa, variant)["blocks"][0]["attn"]
    assert float(mults["wg"]) == float(mults["bg"]) == 0.0 and float(mults["wq"]) == 1.0
    # The script pairs NSA with the full model's draw unless told otherwise.
    assert train_recall.parse_args(["--out", "x"]).init == "paired"


@pytest.mark.slow
def test_runs_as_a_file_without_pythonpath(tmp_path):
    """`python examples/train_recall.py` from a directory where the repository is not on the
    path writes its outputs (they import bench.common, which once failed after the training)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples", "train_recall.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, script, "--preset", "smoke", "--tasks", "needle", "--models", "full",
         "--steps", "2", "--eval_every", "2", "--gen_tokens", "0", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.path.getsize(tmp_path / "summary.csv") > 0


def test_a_task_that_does_not_fit_a_curriculum_length_fails_before_training(tmp_path):
    # The gpu preset's MQAR (32 pairs) has no room at T 256: the script says so before the
    # needle runs (it used to train them, then stop at MQAR without writing anything).
    args = ["--preset", "gpu", "--tasks", "needle,mqar", "--models", "full", "--steps", "10",
            "--curriculum", "256:5", "--out", str(tmp_path)]
    try:
        train_recall.main(args)
    except ValueError as exc:
        assert "'mqar' at T = 256" in str(exc) and "--curriculum" in str(exc)
    else:
        raise AssertionError("no ValueError")
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_ablation_takes_the_key_blocks_out_of_the_selection():
    """`exclude_key_blocks`: the selection of a layer on the ablating backend is the plain one
    with every slot holding a block of the row's queried keys set to -1 (and nothing else
    changed); with n_sel covering every block (everything selected, the selected branch is full
    attention) the ablation changes that layer's output. `ablation_accuracy` reports the three
    accuracies."""
    cfg = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, cmp_block=8,
                    cmp_stride=4, sel_block=16, n_sel=8, window=16)
    task, mc, params, batch = _tiny_mqar("nsa", cfg, n_pairs=4, batch=3, seed=1)
    tokens, key_pos = batch["tokens"], np.asarray(batch["key_pos"])
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 128, cfg.d_model))
    attn = params["blocks"][0]["attn"]
    name = train_recall.exclude_key_blocks(key_pos, cfg, "xla")
    y_plain, plain = nsa_jax.nsa_attention(attn, x, cfg, return_aux=True)
    y_cut, cut = nsa_jax.nsa_attention(attn, x, cfg, backend=(name, "xla"), return_aux=True)
    plain, cut = np.asarray(plain["block_idx"]), np.asarray(cut["block_idx"])
    key_blocks = key_pos // cfg.sel_block                                     # [B, K]
    is_key = (plain[..., None] == key_blocks[:, None, None, None, :]).any(-1)
    assert is_key.any()                    # 8 of 8 blocks selected: every key block is there
    np.testing.assert_array_equal(cut, np.where(is_key, -1, plain))
    assert float(jnp.max(jnp.abs(y_cut - y_plain))) > 1e-3
    out = train_recall.ablation_accuracy(params, tokens, batch["answers"],
                                         key_pos, mc=mc, task=task)
    assert set(out) == {f"acc_excl_{label}" for label, _, _ in train_recall.ABLATIONS}
    assert all(0.0 <= v <= 1.0 for v in out.values())
    # At some positions only: the other positions keep the plain selection.
    positions = np.zeros(128, bool)
    positions[100:] = True
    train_recall.exclude_key_blocks(key_pos, cfg, "xla", positions)
    _, part = nsa_jax.nsa_attention(attn, x, cfg, backend=(name, "xla"), return_aux=True)
    np.testing.assert_array_equal(np.asarray(part["block_idx"]),
                                  np.where(is_key & positions[None, :, None, None], -1, plain))


def _write_curves(path, rows):
    fields = ["task", "model", "step", "eval_acc", "l1_hit"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(dict(zip(fields, row)))


def test_compare_recall_plots_runs_and_prints_last_points(tmp_path, capsys):
    from examples import compare_recall

    a, b = tmp_path / "mqar_s3_curves.csv", tmp_path / "mqar_s0_curves.csv"
    _write_curves(a, [("mqar", "full", 101, 0.2, ""), ("mqar", "full", 1, 0.0, ""),
                      ("mqar", "nsa:x", 1, 0.0, 0.38), ("mqar", "nsa:x", 101, 0.3, 0.5)])
    _write_curves(b, [("mqar", "full", 1, 0.1, ""), ("mqar", "full", 201, 0.7, "")])
    out = tmp_path / "cmp.png"
    assert compare_recall.main([f"{a}:seed3", str(b), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "task", "model", "step", "eval_acc", "l1_hit"]
    # the last step of each run (rows sorted by step), a blank metric shown as '-'
    assert lines[2].split() == ["seed3", "mqar", "full", "101", "0.200", "-"]
    assert lines[3].split() == ["seed3", "mqar", "nsa:x", "101", "0.300", "0.500"]
    assert lines[4].split() == ["mqar_s0", "mqar", "full", "201", "0.700", "-"]
    assert out.stat().st_size > 0


def test_compare_recall_names_a_bad_argument(tmp_path):
    from examples import compare_recall

    a = tmp_path / "a_curves.csv"
    _write_curves(a, [("needle", "full", 1, 0.0, "")])
    with pytest.raises(ValueError, match="--metrics: no input has l9_hit"):
        compare_recall.main([str(a), "--metrics", "eval_acc,l9_hit", "--out",
                             str(tmp_path / "x.png")])
    with pytest.raises(ValueError, match="curves: no file"):
        compare_recall.main([str(tmp_path / "none.csv"), "--out", str(tmp_path / "x.png")])
    (tmp_path / "other.csv").write_text("row,S\n1,2\n")
    with pytest.raises(ValueError, match="not a train_recall curves CSV"):
        compare_recall.main([str(tmp_path / "other.csv"), "--out", str(tmp_path / "x.png")])
