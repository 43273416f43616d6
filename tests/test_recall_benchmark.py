"""examples/recall_benchmark.py on the CPU: the mixed-pair batches keep every key beyond the
window in one format, the loss averages exactly the answered slots (against a float64
computation), a bad length or flag is named before training, the report compares runs at a
step all of them reached, a tiny launch trains, aligns and writes its outputs, and an NSA
run exports its trained selection as a bench workload."""
import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from examples import recall_benchmark as rb
from examples import train_recall
from nsa_common import NSAConfig


def _cfg():
    return NSAConfig.tiny(window=32, d_v=16)


def test_mixed_batch_puts_each_rows_queries_in_the_last_slots():
    cfg, vocab, slots, T = _cfg(), train_recall.Vocab(), 6, 192
    batch = rb.mixed_batch(np.random.default_rng(0), (1, 3, 6), vocab, 64, T, cfg, slots)
    tokens, answers, key_pos = batch["tokens"], batch["answers"], batch["key_pos"]
    first_slot = T - 2 * slots
    counts = (answers >= 0).sum(1)
    assert set(counts) == {1, 3, 6}
    for b in range(64):
        p = counts[b]
        assert (answers[b, :slots - p] == -1).all() and (key_pos[b, :slots - p] == -1).all()
        asked = np.arange(T - 2 * p, T, 2)
        assert np.array_equal(tokens[b, asked], tokens[b, key_pos[b, slots - p:]])
        assert np.array_equal(tokens[b, asked + 1], answers[b, slots - p:])
        assert np.array_equal(tokens[b, key_pos[b, slots - p:] + 1], answers[b, slots - p:])
        # Filler (never a key) in the unused slots; every value beyond the window of the
        # first slot, so no slot's window reaches a pair.
        assert (tokens[b, first_slot:T - 2 * p] < vocab.first_key).all()
        assert (first_slot - (key_pos[b, slots - p:] + 1) >= cfg.window).all()


def test_loss_averages_the_answered_slots_of_each_row():
    cfg = _cfg().replace(d_model=32)
    mc = train_recall.ModelConfig("full", cfg, train_recall.Vocab().size, n_layers=1)
    params = train_recall.init_model(jax.random.PRNGKey(0), mc)
    slots, T = 4, 160
    batch = rb.mixed_batch(np.random.default_rng(1), (1, 4), train_recall.Vocab(), 6, T, cfg,
                           slots)
    loss, (task_loss, kl, acc) = rb.mixed_loss(params, batch["tokens"], batch["answers"], 0.0,
                                               mc=mc, slots=slots, alignment=None)
    h = train_recall.forward(params, jnp.asarray(batch["tokens"]), mc)
    logits = np.asarray(train_recall.logits_at(params, h[:, T - 2 * slots::2]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)
    per_row, correct, answered = [], 0, 0
    for b, row in enumerate(batch["answers"]):
        valid = np.flatnonzero(row >= 0)
        per_row.append(-np.mean(logp[b, valid, row[valid]]))
        correct += (logits[b, valid].argmax(-1) == row[valid]).sum()
        answered += valid.size
    np.testing.assert_allclose(float(task_loss), np.mean(per_row), rtol=1e-5)
    assert float(loss) == float(task_loss) and float(kl) == 0.0
    np.testing.assert_allclose(float(acc), correct / answered, rtol=1e-6)


def test_alignment_loss_joins_the_loss_with_its_weight():
    cfg = _cfg().replace(d_model=32)
    mc = train_recall.ModelConfig("nsa", cfg, train_recall.Vocab().size, n_layers=2)
    params = train_recall.init_model(jax.random.PRNGKey(0), mc)
    batch = rb.mixed_batch(np.random.default_rng(2), (1, 2), train_recall.Vocab(), 2, 160, cfg,
                           2)
    alignment = nsa_jax.AlignmentOptions()
    loss, (task_loss, kl, _) = rb.mixed_loss(params, batch["tokens"], batch["answers"], 3.0,
                                             mc=mc, slots=2, alignment=alignment)
    _, layers = train_recall.forward(params, jnp.asarray(batch["tokens"]), mc, collect=True)
    expected = np.mean([float(nsa_jax.selection_alignment_loss(blk["attn"], a, cfg))
                        for blk, (a, _) in zip(params["blocks"], layers)])
    assert float(kl) > 0
    np.testing.assert_allclose(float(kl), expected, rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(task_loss) + 3.0 * float(kl), rtol=1e-6)


def test_a_pair_count_that_does_not_fit_a_length_is_named_before_training(tmp_path):
    with pytest.raises(ValueError, match="16 pairs at T = 256"):
        rb.main(["--run", "full:1", "--curriculum", "256:10", "--steps", "20",
                 "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "a-b"], "--seeds"), (["--pairs", "0,4"], "--pairs"),
    (["--models", "full,dense"], "--models"), (["--jobs", "0"], "--jobs"),
    (["--dense_frac", "1.5"], "--dense_frac")])
def test_bad_flags_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        rb.parse_args(["--out", str(tmp_path)] + argv)
    assert message in capsys.readouterr().err


def _fake_run(out, model, seed, accs, steps, overlap=None):
    """A finished run's files: evaluations every 2 steps up to `steps`, accuracy accs[i] on
    both tasks at the i-th; `overlap`: (shared, jaccard, tile union) of layer 0."""
    folder = out / f"{model}_s{seed}"
    folder.mkdir()
    curves = [dict(model=model, seed=seed, step=2 * (i + 1), T=64, stage="sparse",
                   acc_needle=a, acc_mqar4=a) for i, a in enumerate(accs)]
    curves[-1]["step"] = steps
    with open(folder / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(curves[0]))
        writer.writeheader()
        writer.writerows(curves)
    summary = dict(model=model, seed=seed, steps=steps, acc_needle=accs[-1], acc_mqar4=accs[-1],
                   kl=None, ms_per_step=1.0, train_s=1.0, compile_s=0.0, finite=True)
    if overlap is not None:
        summary.update(l0_sel_shared=overlap[0], l0_sel_jaccard=overlap[1],
                       l0_sel_tile_union=overlap[2])
    with open(folder / "run.json", "w") as f:
        json.dump(dict(summary=summary, model=model, seed=seed, recipe=None, pairs=[1, 4],
                       recall_args=dict(T=64, steps=8, n_layers=1),
                       nsa=json.loads(json.dumps(_cfg().__dict__))), f)


def test_report_compares_runs_at_a_step_all_reached(tmp_path):
    _fake_run(tmp_path, "full", 1, [0.5, 0.8, 0.9, 1.0], 8)
    _fake_run(tmp_path, "full", 2, [0.4, 0.6, 0.8, 1.0], 8)
    _fake_run(tmp_path, "nsa", 1, [0.3, 0.7, 0.75], 5,   # stopped by its budget at step 5
              overlap=(0.5, 0.4, 20.0))
    _fake_run(tmp_path, "nsa", 2, [0.2, 0.5, 0.6, 0.9], 8, overlap=(0.7, 0.6, 30.0))
    text = rb.report(str(tmp_path))
    assert "| nsa | 0 | 2 | 0.600 (0.500-0.700) | 0.500 (0.400-0.600) | 25.0 (20.0-30.0) |" in text
    final, common = text.split("At step 4,")
    # Last evaluations: nsa seeds at 0.75 / 0.9 against full's 1.0 / 1.0.
    assert "| nsa | 2 | 0.825 (0.750-0.900), -17.5 pt |" in final
    # Step 4 is the last evaluation every run has: nsa 0.7 / 0.5 against full 0.8 / 0.6.
    assert "| full | 2 | 0.700 (0.600-0.800) |" in common
    assert "| nsa | 2 | 0.600 (0.500-0.700), -10.0 pt |" in common
    assert "| nsa | 1 | 5 | 64 | 0.750 | 0.750 | - | 1.0 |" in text
    # At step 8 only nsa seed 2 of the two was evaluated: 0.9 against full seed 2's 1.0.
    text = rb.report(str(tmp_path), steps=(8, 99))
    at8 = text.split("At step 8 (of 8 planned), the 3 of 4 runs evaluated there:")[1]
    assert "| nsa | 1 | 0.900 (0.900-0.900), -10.0 pt |" in at8.split("\n\n")[1]
    assert "At step 99" not in text
    for name in ("results.md", "summary.csv", "curves.png"):
        assert os.path.getsize(tmp_path / name) > 0


def test_selection_overlap_is_the_workload_statistic_of_each_layers_selection():
    cfg = _cfg()
    mc = train_recall.ModelConfig("nsa", cfg, vocab_size=200, n_layers=2, token_shift=True)
    params = train_recall.init_model(jax.random.PRNGKey(3), mc)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 160)), jnp.int32)
    stats = rb.selection_overlap(params, tokens, mc)
    _, layers = train_recall.forward(params, tokens, mc, collect=True)
    for i, (_, aux) in enumerate(layers):
        idx = np.asarray(aux["block_idx"])[:, cfg.n_sel * cfg.sel_block:]
        # Brute force: per sequence, KV head and consecutive rows, the shared blocks / n_sel.
        shared = [len(set(a[a >= 0]) & set(b[b >= 0])) / cfg.n_sel
                  for seq in idx for t in range(idx.shape[1] - 1)
                  for a, b in zip(seq[t], seq[t + 1])]
        assert stats[f"l{i}_sel_shared"] == pytest.approx(np.mean(shared))
        assert 0 < stats[f"l{i}_sel_jaccard"] <= 1


def test_report_names_an_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="no finished run"):
        rb.report(str(tmp_path))


def test_tiny_launch_trains_aligns_and_reports(tmp_path):
    # Two worker processes (one at a time): full attention and the alignment recipe (a dense
    # warm-up of 2 steps, then sparse, the KL on throughout).
    code = rb.main(["--preset", "smoke", "--models", "full,nsa_aligned", "--seeds", "1",
                    "--pairs", "1,2", "--steps", "4", "--eval_every", "2",
                    "--dense_frac", "0.5", "--gpus", "none", "--export_selection", "256",
                    "--out", str(tmp_path)])
    assert code == 0
    assert (tmp_path / "nsa_aligned_s1" / "selection_T256.npy").exists()  # flags reach workers
    with open(tmp_path / "nsa_aligned_s1" / "curves.csv", newline="") as f:
        curve = list(csv.DictReader(f))
    assert [(r["step"], r["stage"]) for r in curve] == [("2", "dense"), ("4", "sparse")]
    assert all(float(r["kl"]) > 0 for r in curve)
    with open(tmp_path / "nsa_aligned_s1" / "run.json") as f:
        assert json.load(f)["dense_steps"] == 2
    text = (tmp_path / "results.md").read_text()
    assert "| nsa_aligned | 1 |" in text and "mqar2" in text


def test_a_stopped_run_resumes_where_it_stopped(tmp_path):
    # Stopped by its budget after the first step, then resumed: every step's loss and the
    # final accuracies are those of the run that was never stopped (CPU: deterministic).
    flags = ["--preset", "smoke", "--models", "nsa_aligned", "--seeds", "1", "--pairs", "1,2",
             "--steps", "4", "--eval_every", "1", "--dense_frac", "0.5", "--gpus", "none"]
    assert rb.main(flags + ["--out", str(tmp_path / "whole")]) == 0
    assert rb.main(flags + ["--out", str(tmp_path / "parts"), "--budget_s", "0"]) == 0
    run = tmp_path / "parts" / "nsa_aligned_s1"
    assert (run / rb.STATE_FILE).exists()
    assert json.loads((run / "run.json").read_text())["summary"]["steps"] == 1
    assert rb.main(flags + ["--out", str(tmp_path / "parts"), "--resume"]) == 0
    assert not (run / rb.STATE_FILE).exists()
    assert "resumed at step 1" in (run / "log.txt").read_text()

    def curve(out):
        with open(out / "nsa_aligned_s1" / "curves.csv", newline="") as f:
            return [{k: r[k] for k in ("step", "stage", "train_loss", "kl", "acc_needle",
                                       "acc_mqar2")} for r in csv.DictReader(f)]

    assert curve(tmp_path / "parts") == curve(tmp_path / "whole")
    # A finished run is left alone.
    assert rb.main(flags + ["--out", str(tmp_path / "parts"), "--resume"]) == 0
    assert "resumed" not in (run / "log.txt").read_text().split("resumed at step 1", 1)[1]


def test_the_gpu_schedule_is_the_reported_setting_and_scales_with_steps(tmp_path):
    _, rest = rb.parse_args(["--out", str(tmp_path)])
    args = rb.recall_args(rest, str(tmp_path))
    assert (args.steps, args.curriculum, args.lr, args.T, args.token_shift) == (
        4500, "512:2250,1024:3375", 1e-3, 2048, True)
    _, rest = rb.parse_args(["--out", str(tmp_path), "--steps=9000"])
    assert rb.recall_args(rest, str(tmp_path)).curriculum == "512:4500,1024:6750"
    _, rest = rb.parse_args(["--out", str(tmp_path), "--steps", "4000", "--curriculum", "1024:10"])
    assert rb.recall_args(rest, str(tmp_path)).curriculum == "1024:10"
    _, rest = rb.parse_args(["--out", str(tmp_path), "--no_token_shift"])
    assert not rb.recall_args(rest, str(tmp_path)).token_shift


def test_a_new_worker_takes_the_least_loaded_gpu():
    slots = rb.GpuSlots(["0", "1"])
    assert [slots.take() for _ in range(3)] == ["0", "1", "0"]
    slots.give_back("1")  # GPU 1's run ended: the next worker goes there, not round-robin
    assert slots.take() == "1"
    slots.give_back("0")
    slots.give_back("0")
    assert slots.take() == "0" and slots.running == {"0": 1, "1": 1}
    none = rb.GpuSlots([])
    assert none.take() is None
    none.give_back(None)


def test_the_strided_recipe_passes_its_query_stride(tmp_path):
    # The same draw and batches: only the loss's queries differ, so its KL does.
    code = rb.main(["--preset", "smoke", "--models", "nsa_aligned,nsa_aligned_s16", "--seeds", "1",
                    "--pairs", "1,2", "--steps", "2", "--eval_every", "2", "--dense_frac", "0.5",
                    "--gpus", "none", "--out", str(tmp_path)])
    assert code == 0
    record = json.loads((tmp_path / "nsa_aligned_s16_s1" / "run.json").read_text())
    every = json.loads((tmp_path / "nsa_aligned_s1" / "run.json").read_text())
    assert record["query_stride"] == 16 and every["query_stride"] == 1
    assert record["summary"]["kl"] > 0 and record["summary"]["kl"] != every["summary"]["kl"]


def test_a_worker_starting_late_gets_what_is_left_of_the_budget(tmp_path, monkeypatch):
    clock = iter([0.0, 5.0, 150.0])  # the launch starts, then two workers start one by one
    monkeypatch.setattr(rb.time, "perf_counter", lambda: next(clock))
    calls = []
    monkeypatch.setattr(rb.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        rb.subprocess.CompletedProcess(argv, 0))
    args, rest = rb.parse_args(["--out", str(tmp_path), "--models", "full", "--seeds", "1,2",
                                "--gpus", "none", "--budget_s", "200"])
    assert rb.launch(args, rest) == []
    assert len(calls) == 1  # the second had 50 s left, under MIN_RUN_S: not started
    assert calls[0][-2:] == ["--budget_s", "195.0"]


def test_report_steps_must_be_positive_integers(tmp_path):
    assert rb.parse_args(["--out", str(tmp_path), "--report_steps", "20,35"])[0].report_steps == (
        20, 35)
    for bad in ("0", "x", "3.5"):
        with pytest.raises(SystemExit):
            rb.parse_args(["--out", str(tmp_path), "--report_steps", bad])


def test_hit_table_averages_each_layers_last_hit_rate_per_task(tmp_path):
    for seed, hit in ((1, 0.2), (2, 0.6)):
        _fake_run(tmp_path, "nsa", seed, [0.3, 0.5], 4)
        path = tmp_path / f"nsa_s{seed}" / "curves.csv"
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        for i, row in enumerate(rows):  # the last evaluation's hit rate counts, not the first
            row.update(l0_hit_needle=hit if i else 0.0, l0_hit_mqar4=hit / 2 if i else 0.0)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    runs = rb.load_runs(str(tmp_path))
    lines = rb.hit_table(runs, ["needle", "mqar4"], ["full", "nsa"])
    assert "| nsa | 0 | 2 | 0.400 (0.200-0.600) | 0.200 (0.100-0.300) |" in lines
    chance = [rb.hit_chance(runs[0], t) for t in ("needle", "mqar4")]
    assert f"| random | - | - | {chance[0]:.3f} | {chance[1]:.3f} |" in lines
    assert rb.hit_table(runs, ["needle", "mqar4"], ["full"]) == []


def test_step_times_times_every_model_stage_and_backend(tmp_path):
    code = rb.main(["--preset", "smoke", "--models", "full,nsa_aligned", "--pairs", "1,2",
                    "--step_times", "64,128", "--backends", "xla;pallas,xla", "--gpus", "none",
                    "--out", str(tmp_path)])
    assert code == 0
    with open(tmp_path / "step_times.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    keys = [(r["model"], r["backend"], r["T"], r["stage"]) for r in rows]
    assert keys == [("full", "-", "64", "sparse"), ("full", "-", "128", "sparse")] + [
        ("nsa_aligned", b, T, stage) for b in ("xla", "pallas,xla") for T in ("64", "128")
        for stage in ("dense", "sparse")]
    assert all(float(r["ms_per_step"]) > 0 for r in rows)
    assert [r["batch"] for r in rows[:2]] == ["8", "4"]  # tokens per step / T


def test_export_saves_each_layers_selection_as_a_bench_workload(tmp_path):
    """--export_selection: an NSA run saves its trained layers' selection at a longer T with
    --export_n_sel blocks, layer-major over the KV groups, as a file the benches load; full
    attention's run exports nothing."""
    flags = ["--preset", "smoke", "--pairs", "1,2", "--steps", "2", "--eval_every", "2",
             "--export_selection", "256", "--export_n_sel", "6", "--out"]
    assert rb.main(["--run", "nsa:1"] + flags + [str(tmp_path / "nsa")]) == 0
    assert rb.main(["--run", "full:1"] + flags + [str(tmp_path / "full")]) == 0
    assert not list((tmp_path / "full").glob("selection_*"))
    meta = json.loads((tmp_path / "nsa" / "run.json").read_text())
    export = meta["exported_selections"]["T256"]
    assert export["file"] == "selection_T256.npy" and export["n_sel"] == 6
    idx = np.load(tmp_path / "nsa" / export["file"])
    nsa = NSAConfig(**meta["nsa"])
    layers = meta["recall_args"]["n_layers"]
    assert idx.dtype == np.int32 and idx.shape == (1, 256, layers * nsa.n_kv_heads, 6)
    # Every query selects its n_init + n_local forced blocks and 6 blocks in all once it has.
    t = np.arange(256)
    eligible = np.minimum(t // nsa.sel_block + 1, 6)
    assert ((idx[0] >= 0).sum(-1) == eligible[:, None]).all()
    # What the bench replays: the file read back for a configuration of layers x G groups.
    from bench import workloads

    bench_cfg = nsa.replace(n_sel=6, n_kv_heads=layers * nsa.n_kv_heads,
                            n_heads=layers * nsa.n_heads)
    np.testing.assert_array_equal(
        workloads.load_selection(str(tmp_path / "nsa" / export["file"]), bench_cfg), idx)
    assert 0 < export["shared"] <= 1 and export["tile_union"] >= 6


def test_a_run_stopped_during_its_export_is_recorded(tmp_path, monkeypatch):
    """The run's curves and run.json are written before the exports, and again after each: a
    launcher that stops a long export keeps the trained run and the exports it finished."""
    calls = []

    def export(params, mc, vocab, T, *rest):
        calls.append(T)
        if len(calls) == 2:
            raise RuntimeError("stopped during the export")
        return dict(file=f"selection_T{T}.npy")

    monkeypatch.setattr(rb, "export_selection", export)
    flags = ["--preset", "smoke", "--pairs", "1,2", "--steps", "2", "--eval_every", "2",
             "--export_selection", "128,256", "--out", str(tmp_path)]
    with pytest.raises(RuntimeError, match="export"):
        rb.main(["--run", "nsa:1"] + flags)
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["summary"]["steps"] == 2 and calls == [128, 256]
    assert meta["exported_selections"] == {"T128": {"file": "selection_T128.npy"}}
    with open(tmp_path / "curves.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["2"]


@pytest.mark.parametrize("argv, message", [
    (["--export_selection", "8k"], "--export_selection"), (["--export_n_sel", "0"],
                                                           "--export_n_sel")])
def test_bad_export_flags_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        rb.parse_args(["--out", str(tmp_path)] + argv)
    assert message in capsys.readouterr().err
