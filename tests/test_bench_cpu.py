"""CPU smoke tests of the benchmark scripts and the one-shot runner (tiny shapes, no timing claims).

They check what the scripts write (CSV columns, statuses, PNG, summaries), that a row which needs
a GPU says "skipped" instead of crashing (the decode breakdown's branch-only step is
`nsa_jax.decode.decode_step_branches`, tested in test_jax_decode / test_pallas_decode).
"""
import csv
import importlib
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from bench import (bench_alignment, bench_decode, bench_prefill, bench_train_step, common,
                   summarize_decode_csv)
from nsa_common import NSAConfig, decode_read_bound

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5  # float32 decode steps compared with each other

TINY_NSA = ["--l", "8", "--d", "4", "--l_sel", "16", "--n_sel", "4", "--w", "16", "--dk", "16",
            "--dv", "16", "--dtype", "float32", "--device", "cpu", "--no_progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 1000


@pytest.fixture
def cpu_env(monkeypatch):
    # setup_device writes JAX_PLATFORMS; monkeypatch restores it afterwards.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("COMMIT", "testcommit")


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_prefill_pads_values_for_one_head_size_baselines(framework):
    """The full-attention baselines that take one head size (cuDNN, FA-3, torch's SDPA flash)
    run d_v < d_k with v zero-padded and the output cut back: exactly the unpadded attention."""
    args = bench_prefill.parse_args(TINY_NSA + ["--S_list", "32", "--dk", "24", "--dv", "16"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((1, 8, 2, 24), (1, 8, 2, 24), (1, 8, 2, 16)))

    def reference(q, k, v):  # any head sizes, BTHD, causal
        s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
        s = np.where(np.tril(np.ones((8, 8), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)

    if framework == "torch":
        torch = pytest.importorskip("torch")

        def one_size(q, k, v):
            assert v.shape[-1] == q.shape[-1]
            return torch.from_numpy(reference(q.numpy(), k.numpy(), v.numpy()))
        arrays = [torch.from_numpy(x) for x in (q, k, v)]
    else:
        import jax.numpy as jnp

        def one_size(q, k, v):
            assert v.shape[-1] == q.shape[-1]
            return jnp.asarray(reference(*(np.asarray(x) for x in (q, k, v))))
        arrays = [jnp.asarray(x) for x in (q, k, v)]
    padded, note = bench_prefill._pad_values(one_size, args, framework)
    assert note == "v zero-padded from d_v 16 to d_k 24"
    np.testing.assert_allclose(np.asarray(padded(*arrays)), reference(q, k, v), rtol=1e-5,
                               atol=1e-6)


def test_prefill_cpu_smoke(tmp_path, cpu_env, capsys):
    out = tmp_path / "prefill"
    rows = "nsa_jax_xla,nsa_jax_pallas,xla_full,projections"
    code = bench_prefill.main(TINY_NSA + ["--S_list", "64", "--H", "4", "--G", "2",
                                          "--d_model", "32", "--rows", rows, "--iters", "2",
                                          "--warmup", "1", "--repeats", "2", "--rotate", "2",
                                          "--isolate", "none", "--out", str(out)])
    assert code == 0
    columns, records = _read(out / "prefill.csv")
    assert columns == bench_prefill.COLUMNS
    by = {(r["row"], int(r["S"]), r["pass"]): r for r in records}
    assert set(by) == {(row, 64, p) for row in rows.split(",") for p in bench_prefill.PASSES}
    for S in (64,):
        for p in bench_prefill.PASSES:
            for row in ("nsa_jax_xla", "xla_full", "projections"):
                r = by[(row, S, p)]
                assert r["status"] == "ok", r
                assert float(r["ms"]) > 0 and float(r["ms_min"]) <= float(r["ms"])
            # The baseline's speed-up over itself is 1; the NSA row names its baseline.
            assert float(by[("xla_full", S, p)]["speedup"]) == pytest.approx(1.0)
            assert by[("nsa_jax_xla", S, p)]["baseline"] == "xla_full"
            assert by[("projections", S, p)]["speedup"] == ""
            # GPU-only rows are recorded as skipped with a reason, not crashes.
            assert by[("nsa_jax_pallas", S, p)]["status"] == "skipped"
            assert by[("nsa_jax_pallas", S, p)]["note"].startswith("skipped: ")
    assert _is_png(out / "prefill.png")
    env = json.loads((out / "prefill_env.json").read_text())
    assert env["commit"] == "testcommit" and "versions" in env
    # The summary table is printed last: its header, a rule, then one line per (row, S).
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-6].split()[:4] == ["row", "S", "fwd_ms", "fwd_bwd_ms"]
    assert [line.split()[0] for line in lines[-4:]] == [
        row for row in bench_prefill.ROWS if row in rows.split(",")]


def test_prefill_isolated_row_and_oom_propagation(tmp_path, cpu_env):
    """--isolate row runs a row in a subprocess; an OOM at one S marks larger S without running."""
    out = tmp_path / "iso"
    code = bench_prefill.main(TINY_NSA + ["--S_list", "32", "--H", "4", "--G", "2",
                                          "--rows", "xla_full", "--iters", "1", "--warmup", "0",
                                          "--repeats", "1", "--out", str(out)])
    assert code == 0
    _, records = _read(out / "prefill.csv")
    assert [r["status"] for r in records] == ["ok", "ok"]

    args = bench_prefill.parse_args(TINY_NSA + ["--S_list", "32,64", "--H", "4", "--G", "2"])
    args.device_label = "cpu"
    calls = []

    def fake_runner(a, S, row):
        calls.append(S)
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    original = bench_prefill.ROW_RUNNERS["xla_full"]
    bench_prefill.ROW_RUNNERS["xla_full"] = fake_runner
    try:
        records = bench_prefill.run_row(args, "xla_full")
    finally:
        bench_prefill.ROW_RUNNERS["xla_full"] = original
    assert calls == [32]
    assert [r["status"] for r in records] == ["oom"] * 4
    assert records[-1]["note"] == "not run: oom at S=32"


def _fake_prefill_run(path, commit, rows_ms, H="64"):
    """A directory as `bench_prefill.py --out` leaves it: prefill.csv and prefill_env.json."""
    records = [dict(bench="prefill", row=row, impl="x", S=S, B="1", H=H, G="4", dk="128",
                    dv="128", dtype="bfloat16", status="ok", ms=ms, ms_min=ms, ms_max=ms,
                    peak_mb=10.0, device="GPU X", **{"pass": p})
               for (row, S, p), ms in rows_ms.items()]
    common.write_csv(os.path.join(path, "prefill.csv"), records, bench_prefill.COLUMNS)
    with open(os.path.join(path, "prefill_env.json"), "w") as f:
        json.dump({"commit": commit}, f)
    return str(path)


def test_prefill_combine_runs(tmp_path, cpu_env, capsys):
    """--combine merges runs of one machine (fla's row needs a call of its own): the first
    run's figure wins where both measured a row, speed-ups are against the merged baseline."""
    a = _fake_prefill_run(tmp_path / "a", "abc1234", {
        ("nsa_jax_pallas", 64, "fwd"): 2.0, ("nsa_jax_pallas", 64, "fwd_bwd"): 6.0,
        ("fa3_full", 64, "fwd"): 4.0, ("fa3_full", 64, "fwd_bwd"): 12.0})
    b = _fake_prefill_run(tmp_path / "b", "abc1234", {
        ("fla_parallel_nsa", 64, "fwd"): 8.0, ("fla_parallel_nsa", 64, "fwd_bwd"): 24.0,
        ("fa3_full", 64, "fwd"): 5.0, ("fa3_full", 64, "fwd_bwd"): 15.0})
    out = tmp_path / "both"
    assert bench_prefill.main(["--combine", f"{a},{b}", "--out", str(out), "--device", "cpu"]) == 0
    columns, latest = _read(out / "prefill_latest.csv")
    assert columns == bench_prefill.LATEST_COLUMNS
    by = {r["row"]: r for r in latest}
    assert list(by) == ["nsa_jax_pallas", "fla_parallel_nsa", "fa3_full"]
    assert float(by["fa3_full"]["fwd_ms"]) == 4.0 and float(by["fa3_full"]["fwd_bwd_ms"]) == 12.0
    assert {r["commit"] for r in latest} == {"abc1234"}
    _, records = _read(out / "prefill.csv")
    speedup = {(r["row"], r["pass"]): float(r["speedup"]) for r in records if r["speedup"]}
    assert speedup[("fla_parallel_nsa", "fwd")] == pytest.approx(0.5)
    assert speedup[("nsa_jax_pallas", "fwd_bwd")] == pytest.approx(2.0)
    assert _is_png(out / "prefill.png")
    assert "on GPU X (commit abc1234)" in capsys.readouterr().out

    other_commit = _fake_prefill_run(tmp_path / "c", "def5678", {("fa3_full", 64, "fwd"): 1.0})
    other_heads = _fake_prefill_run(tmp_path / "d", "abc1234", {("fa3_full", 64, "fwd"): 1.0},
                                    H="32")
    for dirs, match in ([[a, other_commit], "different commits"], [[a, other_heads], "differ in H"],
                        [[a, str(tmp_path / "nowhere")], "does not exist"], [[a], "two or more"]):
        with pytest.raises(ValueError, match=match):
            bench_prefill.combine_runs(dirs, str(tmp_path / "x"))


def test_prefill_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rows"):
        bench_prefill.parse_args(["--rows", "nsa_jax_xla,warp_drive", "--device", "cpu"])
    with pytest.raises(ValueError, match="S_list"):
        bench_prefill.parse_args(["--S_list", "8k,abc", "--device", "cpu"])
    with pytest.raises(ValueError, match="n_sel"):
        bench_prefill.parse_args(TINY_NSA + ["--n_sel", "2"])


@pytest.mark.slow
@pytest.mark.parametrize("timing", ["loop", "dispatch"])
def test_decode_timing_modes_read_the_same(tmp_path, cpu_env, timing):
    """Both timing methods run the same step at position S: the same reads, a time per step,
    and the method named in the CSV."""
    csv_path = tmp_path / "decode.csv"
    S = 40
    code = bench_decode.main(TINY_NSA + ["--B", "2", "--S_list", str(S), "--d_model", "32",
                                         "--H", "4", "--G", "2", "--iters", "2", "--warmup", "1",
                                         "--repeats", "2", "--loop_steps", "3", "--timing",
                                         timing, "--no_breakdown", "--full_impls", "xla",
                                         "--csv", str(csv_path), "--latest_csv", ""])
    assert code == 0
    _, records = _read(csv_path)
    full = {r["row"]: r for r in records}
    for row in ("nsa_jax", "full_xla"):
        assert full[row]["status"] == "ok" and float(full[row]["ms"]) > 0
        assert full[row]["timing"] == ("loop of 3" if timing == "loop" else "dispatch")
    assert (int(full["nsa_jax"]["reads_cmp"]), int(full["nsa_jax"]["reads_win"])) == (
        (S + 1 - 8) // 4 + 1, 16)


def test_a_forced_decode_workload_is_noted_as_leaving_out_the_selection(tmp_path, cpu_env):
    """A decode row on a forced workload (coherent) says that its step ran no selection
    kernels; the random workload's row (its own selection) says nothing of the kind."""
    notes = {}
    for workload in ("coherent", "random"):
        csv_path = tmp_path / f"decode_{workload}.csv"
        code = bench_decode.main(TINY_NSA + [
            "--B", "1", "--S_list", "40", "--d_model", "32", "--H", "4", "--G", "2",
            "--iters", "1", "--warmup", "1", "--repeats", "1", "--loop_steps", "2",
            "--no_breakdown", "--full_impls", "xla", "--workload", workload,
            "--csv", str(csv_path), "--latest_csv", ""])
        assert code == 0
        _, records = _read(csv_path)
        nsa = next(r for r in records if r["row"] == "nsa_jax")
        assert nsa["status"] == "ok" and nsa["workload"] == workload
        notes[workload] = nsa["note"] or ""
    assert "no selection kernels" in notes["coherent"]
    assert "selection" not in notes["random"]


def test_decode_full_step_pads_the_value_cache(cpu_env):
    """The full-attention decode baseline with d_v < d_k keeps its v cache at d_k columns, zeros
    past d_v, and cuts o back: the step equals attention over the unpadded values."""
    import jax
    import jax.numpy as jnp

    args = bench_decode.parse_args(TINY_NSA + ["--device", "cpu", "--dtype", "float32",
                                               "--d_model", "32", "--H", "4", "--G", "2",
                                               "--dk", "16", "--dv", "8"])
    B, S, H, G, dk, dv = 2, 24, 4, 2, 16, 8
    step, params, xs, make_cache = bench_decode.full_setup(args, "xla", B, S)
    cache = make_cache()
    assert cache[1].shape[-1] == dk and not np.any(np.asarray(cache[1][..., dv:]))
    y, (k_cache, v_cache, _) = step(params, xs[0], args.cfg, cache)
    assert not np.any(np.asarray(v_cache[..., dv:]))
    q = (xs[0] @ params["w_qkv"])[..., :H * dk].reshape(B, H, dk)
    k, v = np.asarray(k_cache[:, :S + 1]), np.asarray(v_cache[:, :S + 1, :, :dv])
    s = np.einsum("bhd,bshd->bhs", np.asarray(q), np.repeat(k, H // G, axis=2)) / np.sqrt(dk)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhs,bshd->bhd", p / p.sum(-1, keepdims=True), np.repeat(v, H // G, axis=2))
    want = o.reshape(B, 1, H * dv) @ np.asarray(params["wo"])
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("gqa", [True, False])
def test_decode_torch_full_step_matches_float64(gqa):
    """The FA-2 baseline's torch step (here on SDPA's math backend, float32, CPU) with d_v < d_k:
    the token's K/V land at row pos, v's cache stays zero past d_v, and y equals a float64
    computation of attention over rows 0..pos; GQA by enable_gqa or by expanded K/V alike."""
    torch = pytest.importorskip("torch")

    args = bench_decode.parse_args(TINY_NSA + ["--d_model", "32", "--H", "4", "--G", "2",
                                               "--dk", "16", "--dv", "8", "--rotate", "2"])
    B, S, H, G, dk, dv = 2, 24, 4, 2, 16, 8
    step, st = bench_decode.torch_full_setup(args, B, S, backend="math", gqa=gqa)
    for i, pos in enumerate((S, S + 1)):
        y = step(i, pos)
        x = st["xs"][i % 2].double()
        q, k_new, v_new = (x @ st["w_qkv"].double()).split([H * dk, G * dk, G * dv], dim=-1)
        kc, vc = st["k_cache"].double(), st["v_cache"].double()
        torch.testing.assert_close(kc[:, :, pos], k_new.view(B, G, dk), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[:, :, pos, :dv], v_new.view(B, G, dv), rtol=1e-5,
                                   atol=1e-5)
        assert not vc[..., dv:].any()
        k = kc[:, :, :pos + 1].repeat_interleave(H // G, dim=1)
        v = vc[:, :, :pos + 1, :dv].repeat_interleave(H // G, dim=1)
        p = torch.softmax(torch.einsum("bhd,bhsd->bhs", q.view(B, H, dk), k) / dk ** 0.5, -1)
        want = torch.einsum("bhs,bhsd->bhd", p, v).reshape(B, 1, H * dv) @ st["wo"].double()
        torch.testing.assert_close(y.double(), want, rtol=2e-5, atol=2e-5)
    y0 = bench_decode.torch_full_setup(args, B, S, attention=False)[0](0, S)
    assert y0.shape == (B, 1, 32)


def test_decode_fa2_row_skips_on_cpu(tmp_path, cpu_env):
    code = bench_decode.main(TINY_NSA + ["--B", "1", "--S_list", "40", "--full_impls", "xla,fa2",
                                         "--no_breakdown", "--warmup", "0", "--repeats", "1",
                                         "--rotate", "1", "--loop_steps", "1",
                                         "--csv", str(tmp_path / "d.csv")])
    assert code == 0
    rows = {r["row"]: r for r in _read(tmp_path / "d.csv")[1]}
    assert rows["full_fa2"]["status"] == "skipped"
    assert "FlashAttention-2" in rows["full_fa2"]["note"]
    assert rows["full_xla"]["status"] == "ok"


def test_decode_set_reaches_the_pallas_decode_kernels(tmp_path, cpu_env):
    """--decode_set replaces DecodeBlockSizes fields for the Pallas step (interpret mode on a
    CPU): the row's impl names them and the step runs; a bad field or backend is refused."""
    S = 40
    code = bench_decode.main(TINY_NSA + ["--B", "1", "--S_list", str(S), "--d_model", "32",
                                         "--H", "4", "--G", "2", "--dk", "24", "--dv", "16",
                                         "--backend", "pallas", "--decode_set", "split_dk=False",
                                         "--no_breakdown", "--iters", "1", "--warmup", "0",
                                         "--repeats", "1", "--rotate", "1", "--loop_steps", "1",
                                         "--csv", str(tmp_path / "d.csv")])
    assert code == 0
    rows = {r["row"]: r for r in _read(tmp_path / "d.csv")[1]}
    assert rows["nsa_jax"]["status"] == "ok"
    assert rows["nsa_jax"]["impl"] == "nsa_jax.decode_step (pallas split_dk=False)"
    with pytest.raises(ValueError, match="field of DecodeBlockSizes"):
        bench_decode.parse_args(["--device", "cpu", "--backend", "pallas",
                                 "--decode_set", "split=1"])
    with pytest.raises(ValueError, match="needs --backend pallas"):
        bench_decode.parse_args(["--device", "cpu", "--decode_set", "split_dk=False"])
    # A value of the wrong type is refused, not read as true ("false" is a non-empty string).
    for bad, kind in (("split_dk=false", "bool"), ("block_cmp=64.0", "int"),
                      ("num_warps=True", "int")):
        with pytest.raises(ValueError, match=f"must be {kind}"):
            bench_decode.parse_args(["--device", "cpu", "--backend", "pallas",
                                     "--decode_set", bad])


def test_decode_rejects_bad_loop_steps():
    with pytest.raises(ValueError, match="loop_steps"):
        bench_decode.parse_args(["--device", "cpu", "--loop_steps", "0"])


@pytest.mark.slow
def test_decode_cpu_smoke(tmp_path, cpu_env, capsys):
    csv_path = tmp_path / "decode" / "decode.csv"
    S = 40
    code = bench_decode.main(TINY_NSA + ["--B", "2", "--S_list", str(S), "--d_model", "32",
                                         "--H", "4", "--G", "2", "--iters", "2",
                                         "--warmup", "1", "--repeats", "1", "--rotate", "2",
                                         "--full_impls", "xla,fa3", "--branch_force_mode", "sel",
                                         "--csv", str(csv_path),
                                         "--latest_csv", str(tmp_path / "decode_latest.csv")])
    assert code == 0
    columns, latest = _read(tmp_path / "decode_latest.csv")
    assert ",".join(columns) == ("B,S,nsa_ms,fa3_ms,cudnn_ms,speedup,reads,formula,device,commit,"
                                 "workload,nsa_attn_ms,fa3_attn_ms,attn_speedup")
    assert len(latest) == 1 and latest[0]["fa3_ms"] == "" and latest[0]["commit"] == "testcommit"
    _, breakdown = _read(tmp_path / "decode_latest_breakdown.csv")
    assert [r["mode"] for r in breakdown] == ["sel", "base"]
    columns, records = _read(csv_path)
    assert columns == bench_decode.COLUMNS
    by = {(r["row"], r["mode"]): r for r in records}
    # Gates forced to sel: the breakdown times the sel-only and the no-attention steps.
    assert set(by) == {("nsa_jax", m) for m in ("full", "sel", "base")} | {
        ("full_xla", "full"), ("full_fa3", "full")}
    full = by[("nsa_jax", "full")]
    assert full["status"] == "ok" and float(full["ms"]) > 0
    # Each side's attention alone: its step less the same step without attention.
    assert float(by[("full_xla", "full")]["attn_ms"]) >= 0 and float(full["attn_ms"]) >= 0
    assert "without attention" in by[("full_xla", "full")]["note"]
    cfg = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, cmp_block=8,
                    cmp_stride=4, sel_block=16, n_sel=4, window=16)
    assert int(full["reads_formula"]) == decode_read_bound(cfg, S)
    reads = {b: int(full[f"reads_{b}"]) for b in ("cmp", "sel", "win")}
    assert reads["cmp"] == (S + 1 - 8) // 4 + 1 and reads["win"] == 16
    assert int(full["reads_actual"]) == sum(reads.values()) <= int(full["reads_formula"])
    assert int(full["reads_full"]) == S + 1
    assert {r["force"] for r in records} == {"sel"}
    for mode in ("sel", "base"):
        assert by[("nsa_jax", mode)]["status"] == "ok"
        assert float(by[("nsa_jax", mode)]["share_of_step"]) > 0
    assert float(by[("nsa_jax", "sel")]["attn_ms"]) == pytest.approx(
        max(0.0, float(by[("nsa_jax", "sel")]["ms"]) - float(by[("nsa_jax", "base")]["ms"])),
        abs=1e-4)
    assert by[("full_xla", "full")]["status"] == "ok"
    assert by[("full_fa3", "full")]["status"] == "skipped"
    assert full["baseline"] == "full_xla"
    assert float(full["speedup_vs_full"]) == pytest.approx(
        float(by[("full_xla", "full")]["ms"]) / float(full["ms"]), rel=1e-3)
    assert _is_png(tmp_path / "decode" / "decode.png")
    assert (tmp_path / "decode" / "decode_summary.txt").exists()
    assert "speedup" in capsys.readouterr().out


def test_profile_decode_busy_time_is_the_union_of_intervals():
    from bench.profile_decode import busy_ns

    events = [("a", 0, 10), ("b", 5, 12), ("c", 20, 25), ("d", 21, 22)]
    assert busy_ns(events) == 12 + 5
    assert busy_ns([]) == 0


def test_profile_decode_ranks_kernels_with_their_call_spread():
    """A kernel whose work lands on one step in four (as the compression's does) shows a median
    call far under its longest; the ranking is by summed time, per step."""
    from bench.profile_decode import rank_kernels

    events = [("compress", 0, 1000), ("compress", 2000, 3000), ("compress", 4000, 5000),
              ("compress", 6000, 46000), ("gemm", 0, 12000), ("gemm", 13000, 25000)]
    compress, gemm = rank_kernels(events, steps=4, busy_ms=0.02, top=5)
    assert compress["kernel"] == "compress" and gemm["kernel"] == "gemm"
    assert compress["per_step"] == 1.0 and compress["us_per_step"] == pytest.approx(10.75)
    assert compress["us_median"] == pytest.approx(1.0) and compress["us_max"] == pytest.approx(40)
    assert gemm["us_median"] == gemm["us_max"] == pytest.approx(12)
    assert gemm["share_of_busy"] == pytest.approx(6 / 20)
    assert [k["kernel"] for k in rank_kernels(events, 4, 0.02, top=1)] == ["compress"]


@pytest.mark.slow
def test_profile_decode_cpu_smoke(tmp_path, cpu_env):
    from bench import profile_decode

    csv_path = tmp_path / "profile.csv"
    code = profile_decode.main(TINY_NSA + ["--B", "2", "--S_list", "40", "--d_model", "32",
                                           "--H", "4", "--G", "2", "--loop_steps", "2",
                                           "--warmup", "1", "--rows", "nsa,nsa_base,fa3",
                                           "--label", "smoke", "--csv", str(csv_path)])
    assert code == 0
    columns, records = _read(csv_path)
    assert columns == profile_decode.COLUMNS
    by = {r["what"]: r for r in records}
    for what in ("nsa", "nsa_base"):
        assert by[what]["status"] == "ok" and by[what]["label"] == "smoke"
        assert float(by[what]["wall_ms"]) > 0 and float(by[what]["kernels_per_step"]) > 0
    assert by["fa3"]["status"] == "skipped"
    _, kernels = _read(tmp_path / "profile_kernels.csv")
    assert {k["what"] for k in kernels} == {"nsa", "nsa_base"}
    with pytest.raises(ValueError, match="rows"):
        profile_decode.parse_args(["--device", "cpu", "--rows", "nsa,warp"])
    tiles = profile_decode.parse_decode_blocks("block_cmp=128, num_stages=3,append_kernel=false")
    assert (tiles.block_cmp, tiles.num_stages, tiles.append_kernel) == (128, 3, False)
    for bad in ("block_cmp=96", "tile=64", "block_cmp=x", "append_kernel=2"):
        with pytest.raises(ValueError, match="decode_blocks"):
            profile_decode.parse_decode_blocks(bad)


NSA_SCRIPTS = ("bench_prefill", "bench_decode", "breakdown_prefill", "bench_selection",
               "bench_compressed", "bench_torch_paths", "bench_scaling", "memory_layer",
               "profile_decode", "bench_train_step", "bench_alignment")


def test_every_script_takes_the_nsa_settings_alike():
    """One parser (common.add_nsa_args): the same flags give the same NSAConfig in every script,
    a flag left out keeps the preset's value, and the old spellings are gone."""
    argv = ["--preset", "tiny", "--H", "8", "--G", "2", "--dk", "32", "--dv", "16", "--l", "8",
            "--d", "4", "--l_sel", "16", "--n_sel", "5", "--n_local", "1", "--w", "32",
            "--d_model", "48", "--compress", "mean"]
    want = NSAConfig.tiny(n_heads=8, n_kv_heads=2, d_k=32, d_v=16, cmp_block=8, cmp_stride=4,
                          sel_block=16, n_sel=5, n_local=1, window=32, d_model=48,
                          compress="mean")
    for name in NSA_SCRIPTS:
        parser = importlib.import_module(f"bench.{name}").build_parser()
        assert common.finish_args(parser.parse_args(argv)).cfg == want, name
        preset = parser.get_default("preset")
        assert common.finish_args(parser.parse_args([])).cfg == common.nsa_preset(preset), name
        for old in (["--heads", "4"], ["--groups", "2"], ["--dim", "32"], ["--kv-heads", "2"]):
            with pytest.raises(SystemExit):
                parser.parse_args(old)
    assert common.nsa_preset("bench") == NSAConfig.paper(d_k=128)
    with pytest.raises(ValueError, match="cmp_stride"):
        common.finish_args(bench_decode.build_parser().parse_args(["--d", "5"]))


def test_fla_agreement_takes_the_nsa_settings_with_fla_fields_pinned():
    """fla_agreement reads the same flags; fla's configuration then pins l = d = l_sel, mean
    compression and shared k/v (the `*_fla` rows of bench_prefill), whatever --l/--d say."""
    from bench import fla_agreement, fla_setup

    parser = fla_agreement.build_parser()
    argv = ["--preset", "tiny", "--H", "32", "--G", "2", "--dk", "16", "--dv", "16", "--l", "8",
            "--d", "4", "--l_sel", "8", "--n_sel", "4", "--w", "16"]
    want = NSAConfig.tiny(n_heads=32, n_kv_heads=2, d_k=16, d_v=16, cmp_block=8, cmp_stride=8,
                          sel_block=8, n_sel=4, window=16, compress="mean", shared_kv=True)
    assert fla_agreement.fla_config(parser.parse_args(argv)) == want
    # the defaults: the bench preset (H 64, G 4, d_k = d_v = 128, l_sel 64, n_sel 16, w 512)
    assert fla_agreement.parse_args([]).cfg == fla_setup.fla_config(common.nsa_preset("bench"))
    # l_sel below the preset's stride: fla's l = d = l_sel is applied before the config's checks
    assert fla_agreement.parse_args(["--H", "16", "--G", "1", "--l_sel", "8", "--n_sel", "4"]
                                    ).cfg.cmp_stride == 8
    with pytest.raises(ValueError, match=r"n_init \(2\) must be 1 and n_local \(2\) 2"):
        fla_agreement.parse_args(["--n_init", "2", "--n_sel", "16"])
    for old in (["--heads", "4"], ["--groups", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(old)


def test_bench_modules_import_no_cycle():
    """The bench modules import each other without a cycle (bench_prefill and fla_agreement once
    imported each other; what they share is in fla_setup)."""
    import ast

    names = {name[:-3] for name in os.listdir(os.path.join(REPO, "bench")) if name.endswith(".py")}
    imports = {}
    for name in names:
        with open(os.path.join(REPO, "bench", f"{name}.py")) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("bench", None):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("bench."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
        imports[name] = found & names - {name}
    assert imports["bench_prefill"] and imports["fla_agreement"]  # the walk sees imports

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in imports[start])

    assert [name for name in sorted(names) if reaches(name, name)] == []


def test_force_gates_rejects_unknown_branch():
    import jax.numpy as jnp

    cfg = NSAConfig.tiny()
    params = {"wg": jnp.zeros((cfg.d_model, 3 * cfg.n_heads)), "bg": jnp.zeros(3 * cfg.n_heads)}
    with pytest.raises(ValueError, match="branch_force_mode"):
        bench_decode.force_gates(params, cfg, "all")


def test_summarize_decode_csv(tmp_path, capsys):
    rows = [
        dict(row="nsa_jax", mode="full", B=32, S=65536, status="ok", ms=2.0, reads_actual=5600,
             reads_formula=5631, speedup_vs_full=8.5, baseline="full_fa3", attn_ms=1.7,
             attn_speedup=9.4),
        dict(row="nsa_jax", mode="cmp", B=32, S=65536, status="ok", ms=0.5, share_of_step=0.25),
        dict(row="nsa_jax", mode="sel", B=32, S=65536, status="ok", ms=1.0, share_of_step=0.5),
        dict(row="nsa_jax", mode="win", B=32, S=65536, status="ok", ms=0.4, share_of_step=0.2),
        dict(row="nsa_jax", mode="base", B=32, S=65536, status="ok", ms=0.3, share_of_step=0.15),
        dict(row="full_fa3", mode="full", B=32, S=65536, status="ok", ms=17.0, attn_ms=16.0),
        dict(row="full_cudnn", mode="full", B=32, S=65536, status="oom"),
    ]
    path = tmp_path / "d.csv"
    common.write_csv(str(path), rows, bench_decode.COLUMNS)
    assert summarize_decode_csv.main([str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == summarize_decode_csv.HEADER
    cells = lines[2].split()
    assert cells[:9] == ["32", "65536", "2.00", "0.250", "0.500", "0.200", "0.300", "5600",
                         "5631"]
    assert cells[9:] == ["65537", "17.00", "full_fa3", "8.50", "1.70", "16.00", "9.40", "ok/oom"]
    with pytest.raises(SystemExit):
        summarize_decode_csv.main([str(tmp_path / "missing.csv")])


def test_common_helpers(tmp_path):
    assert common.parse_int_list("8k, 16k,100", "--S_list") == [8192, 16384, 100]
    for bad in ("", "8k,x", "0"):
        with pytest.raises(ValueError, match="--S_list"):
            common.parse_int_list(bad, "--S_list")
    assert common.classify_exception(RuntimeError("RESOURCE_EXHAUSTED: out of memory")) == "oom"
    assert common.classify_exception(ValueError("bad shape")) == "error"
    with pytest.raises(ValueError, match="columns"):
        common.write_csv(str(tmp_path / "x.csv"), [{"a": 1, "b": 2}], ["a"])
    with pytest.raises(ValueError, match="iters"):
        common.time_jax(lambda i: i, iters=0, warmup=0)

    import jax.numpy as jnp

    calls = []

    def step(i):
        calls.append(i)
        return jnp.ones(4) * i

    timing = common.time_jax(step, iters=3, warmup=2, repeats=4)
    assert calls == list(range(2 + 3 * 4)) and timing.samples == 4
    assert 0 < timing.ms_min <= timing.ms <= timing.ms_max
    timing = common.time_torch(lambda i: calls.append(i), iters=2, warmup=1, repeats=3,
                               device="cpu")
    assert timing.samples == 6 and timing.ms >= 0


def _fake_python(tmp_path):
    """A python that fails the sanity script (exit 3) and runs everything else for real."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in scripts/gpu_sanity.py) echo boom; exit 3;; '
                       f'esac\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_runner_records_failures_and_tars(tmp_path):
    art = tmp_path / "art"
    tar_path = tmp_path / "out" / "runner.tar.gz"
    env = dict(os.environ, ARTIFACTS_DIR=str(art), RUNNER_TAR=str(tar_path), COMMIT="abc123",
               PYTHON=_fake_python(tmp_path), RUNNER_STEPS="sanity,multi_gpu,summaries")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "runner_oneshot.sh")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((art / "summary.json").read_text())
    assert summary["commit"] == "abc123"
    steps = {s["step"]: s for s in summary["steps"]}
    assert set(steps) == {"sanity", "multi_gpu", "summaries"}
    assert steps["sanity"]["status"] == "failed" and steps["sanity"]["rc"] == "3"
    assert steps["multi_gpu"]["status"] == "skipped"  # no GPU here
    assert "needs 2 or more" in steps["multi_gpu"]["log"]
    assert steps["summaries"]["status"] == "ok"
    assert "boom" in (art / "logs" / "sanity.log").read_text()
    assert "sanity       failed" in (art / "summary.txt").read_text()
    with tarfile.open(tar_path) as tar:
        names = tar.getnames()
    assert "art/summary.txt" in names and "art/logs/sanity.log" in names


def test_runner_script_syntax():
    subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", "runner_oneshot.sh")], check=True)


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """bench.common.git_commit: HEAD's sha for a clean tree, "-dirty" appended once a tracked
    file changes (untracked files do not count), "unknown" outside a repository, COMMIT first."""
    import subprocess

    from bench import common

    monkeypatch.delenv("COMMIT", raising=False)
    monkeypatch.setattr(common, "REPO_ROOT", str(tmp_path))
    assert common.git_commit() == "unknown"

    def git(*argv):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv],
                              cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    sha = git("rev-parse", "HEAD").strip()
    assert common.git_commit() == sha
    (tmp_path / "b.py").write_text("untracked\n")
    assert common.git_commit() == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    assert common.git_commit() == sha + "-dirty"
    monkeypatch.setenv("COMMIT", "given")
    assert common.git_commit() == "given"


def test_fused_engines_cpu_writes_skip_rows(tmp_path, cpu_env):
    from bench import bench_fused_engines

    rows = bench_fused_engines.main(["--device", "cpu", "--S_list", "1k,2k", "--out",
                                     str(tmp_path), "--no_progress"])
    assert [r["S"] for r in rows] == [1024, 2048]
    assert all(r["status"].startswith("skip") for r in rows)
    header = (tmp_path / "fused_engines.csv").read_text().splitlines()[0]
    assert header == ",".join(bench_fused_engines.COLUMNS)
    with pytest.raises(ValueError, match="--S_list"):
        bench_fused_engines.main(["--device", "cpu", "--S_list", "x", "--out", str(tmp_path)])


def test_fused_engines_of_the_paper_heads(tmp_path, cpu_env, monkeypatch):
    """d_k 192 / d_v 128: cuDNN as the layer calls it and with v padded, no FA-3 (this build
    takes heads <= 128); d_k = d_v: no padded engine; --dv above --dk is refused."""
    from types import SimpleNamespace

    from bench import bench_fused_engines
    from nsa_jax.xla import cudnn

    monkeypatch.setattr(cudnn, "takes", lambda q, k, v: True)
    monkeypatch.setattr(cudnn, "fa3_takes", lambda q, k, v: q.shape[-1] <= 128)
    args = SimpleNamespace(dk=192, dv=128, H=8, G=2, window=64, cmp_block=32, cmp_stride=16)
    table = bench_fused_engines.forms(args, 1024)
    for form, (q_shape, k_shape, v_shape, engines) in table.items():
        assert list(engines) == ["cudnn", "cudnn_padded"], form
        assert q_shape[-1] == k_shape[-1] == 192 and v_shape[-1] == 128
    args.dk = 128
    assert all(list(e[-1]) == ["cudnn", "fa3"] for e in
               bench_fused_engines.forms(args, 1024).values())
    with pytest.raises(ValueError, match="--dv"):
        bench_fused_engines.main(["--device", "cpu", "--S_list", "1k", "--dk", "64", "--dv",
                                  "128", "--out", str(tmp_path)])


def test_failure_status_of_an_isolated_row():
    """A worker killed at its time limit is TIMEOUT even when the note carries its log's tail
    (run_row_subprocess appends it when no record came back); any other failure is ERROR."""
    from bench import common

    assert common.failure_status("timeout: ...compiling") == common.TIMEOUT
    assert common.failure_status(common.TIMEOUT) == common.TIMEOUT
    assert common.failure_status("worker exit 1: Traceback") == common.ERROR
    assert common.failure_status(None) == common.ERROR


@pytest.mark.parametrize("stride", [1, 3])
def test_alignment_bench_cpu_sparse(tmp_path, cpu_env, capsys, stride):
    """The sparse loss and its three pieces timed on the CPU (XLA): a row each, the loss's
    share 1, the summary printed; with a query stride the lse is part of the kl piece."""
    code = bench_alignment.main(["--device", "cpu", "--preset", "tiny", "--T_list", "96",
                                 "--dtype", "float32", "--iters", "1", "--warmup", "0",
                                 "--repeats", "1", "--no_progress", "--query_stride",
                                 str(stride), "--out", str(tmp_path)])
    assert code == 0
    columns, rows = _read(tmp_path / "alignment.csv")
    assert columns == bench_alignment.COLUMNS
    assert [r["piece"] for r in rows] == [p for p in bench_alignment.PIECES
                                          if stride == 1 or p != "lse"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    assert {r["query_stride"] for r in rows} == {str(stride)}
    assert float(rows[0]["share_of_loss"]) == 1.0
    assert "Selection-alignment loss, mode=sparse" in capsys.readouterr().out


TINY_TRAIN = ["--device", "cpu", "--preset", "tiny", "--dv", "16", "--T_list", "64",
              "--layers", "1", "--dtype", "float32", "--iters", "1", "--warmup", "1",
              "--repeats", "1"]


def test_train_step_cpu_full_attention_row(tmp_path, cpu_env, capsys):
    """The full-attention step runs (the example's train_step: a time, a compile time, XLA's
    peak), the GPU-only rows say why they were skipped, the latest CSV names the commit, and the
    table is printed."""
    out = tmp_path / "train_step"
    code = bench_train_step.main(TINY_TRAIN + ["--rows", "fa3_full,xla_full,cudnn_full",
                                               "--isolate", "none", "--out", str(out)])
    assert code == 0
    columns, records = _read(out / "train_step.csv")
    assert columns == bench_train_step.COLUMNS
    by = {r["row"]: r for r in records}
    assert list(by) == ["cudnn_full", "fa3_full", "xla_full"]  # the run order, T 64 each
    full = by["xla_full"]
    assert full["status"] == "ok", full
    assert float(full["ms"]) > 0 and float(full["compile_s"]) > 0 and float(full["peak_mb"]) > 0
    assert float(full["speedup"]) == pytest.approx(1.0) and full["baseline"] == "xla_full"
    assert full["impl"].startswith("train_recall.train_step")
    for row in ("cudnn_full", "fa3_full"):
        assert by[row]["status"] == "skipped" and "needs a GPU" in by[row]["note"]
    columns, latest = _read(out / "train_step_latest.csv")
    assert columns == bench_train_step.LATEST_COLUMNS
    assert {r["commit"] for r in latest} == {"testcommit"}
    assert [r["status"] for r in latest] == ["skipped: cudnn_full needs a GPU",
                                             "skipped: fa3_full needs a GPU", ""]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-5].split()[:4] == ["row", "T", "ms", "kl_share"]


def test_train_step_rows_in_their_own_processes(tmp_path, cpu_env):
    """--isolate row (the default): each row's records come back from its own process."""
    code = bench_train_step.main(TINY_TRAIN + ["--rows", "cudnn_full,fa3_full", "--T_list",
                                               "64,128", "--out", str(tmp_path)])
    assert code == 0
    _, records = _read(tmp_path / "train_step.csv")
    assert [(r["row"], r["T"], r["status"]) for r in records] == [
        ("cudnn_full", "64", "skipped"), ("cudnn_full", "128", "skipped"),
        ("fa3_full", "64", "skipped"), ("fa3_full", "128", "skipped")]
    assert all("needs a GPU" in r["note"] for r in records)


def test_train_step_profile_lists_each_points_costliest_kernels(tmp_path, cpu_env):
    """--profile_top N: each point's step is traced once; its busy time and launches join the
    record (the records also pass through a row's own process) and its N costliest kernels,
    ranked by time, go to train_step_kernels.csv."""
    code = bench_train_step.main(TINY_TRAIN + ["--rows", "xla_full,nsa", "--profile_top", "3",
                                               "--out", str(tmp_path)])
    assert code == 0
    _, records = _read(tmp_path / "train_step.csv")
    assert [r["row"] for r in records] == ["xla_full", "nsa"]
    for r in records:
        assert r["status"] == "ok" and float(r["busy_ms"]) > 0 and float(r["kernels"]) >= 1
    columns, kernels = _read(tmp_path / "train_step_kernels.csv")
    assert columns == bench_train_step.KERNEL_COLUMNS
    for row in ("xla_full", "nsa"):
        mine = [k for k in kernels if k["row"] == row]
        assert [k["rank"] for k in mine] == [str(i + 1) for i in range(len(mine))]
        assert 1 <= len(mine) <= 3 and all(k["T"] == "64" and k["kernel"] for k in mine)
        times = [float(k["us_per_step"]) for k in mine]
        assert times == sorted(times, reverse=True) and times[-1] > 0
    with pytest.raises(ValueError, match="--profile_top"):
        bench_train_step.parse_args(["--device", "cpu", "--profile_top", "-1"])


def test_train_step_alignment_share_and_speedup():
    """kl_share = (ms - nsa's ms) / ms at the same T; the speed-up is against FA-3, else cuDNN."""
    def record(row, T, ms):
        return {"row": row, "T": T, "status": "ok", "ms": ms}

    records = [record("nsa", 8192, 40.0), record("nsa_kl_dense", 8192, 50.0),
               record("nsa_kl_sparse", 16384, 90.0), record("cudnn_full", 8192, 60.0),
               record("fa3_full", 8192, 55.0), record("cudnn_full", 16384, 180.0),
               dict(record("nsa", 16384, None), status="oom")]
    bench_train_step.add_derived(records)
    by = {(r["row"], r["T"]): r for r in records}
    assert by[("nsa_kl_dense", 8192)]["kl_share"] == pytest.approx(0.2)
    assert "kl_share" not in by[("nsa_kl_sparse", 16384)]  # no nsa figure at 16k
    assert by[("nsa", 8192)]["speedup"] == pytest.approx(55 / 40)
    assert by[("nsa", 8192)]["baseline"] == "fa3_full"
    assert by[("nsa_kl_sparse", 16384)]["speedup"] == pytest.approx(2.0)
    assert by[("nsa_kl_sparse", 16384)]["baseline"] == "cudnn_full"
    assert "speedup" not in by[("nsa", 16384)]


def test_train_step_budget_keeps_time_for_the_rows_after(tmp_path, cpu_env, monkeypatch):
    """--budget_s: a row's process may use the budget left less the reserve of each row after
    it; a row whose process ran out of time is recorded "timeout" at every T it did not finish."""
    timeouts = []

    def fake_worker(script, argv, row, timeout_s, tmp_dir):
        timeouts.append(timeout_s)
        return [], "timeout"

    monkeypatch.setattr(bench_train_step.common, "run_row_subprocess", fake_worker)
    code = bench_train_step.main(TINY_TRAIN + ["--rows", "cudnn_full,fa3_full,xla_full",
                                               "--T_list", "64,128", "--budget_s", "100",
                                               "--out", str(tmp_path)])
    assert code == 0
    reserve = bench_train_step.ROW_RESERVE_S
    assert timeouts == pytest.approx([100 - 2 * reserve, 100 - reserve, 100], abs=5)
    _, records = _read(tmp_path / "train_step.csv")
    assert len(records) == 6 and {r["status"] for r in records} == {"timeout"}


@pytest.mark.slow
def test_train_step_cpu_nsa_rows(tmp_path, cpu_env):
    """The NSA rows (XLA backend on a CPU): without and with the alignment loss, both modes, and
    the dense warm-up step; the alignment rows carry their share of the step and a finite loss."""
    out = tmp_path / "train_step_nsa"
    rows = ["nsa", "nsa_kl_sparse", "nsa_kl_dense", "nsa_warmup"]
    code = bench_train_step.main(TINY_TRAIN + ["--rows", ",".join(rows), "--isolate", "none",
                                               "--query_stride", "2", "--out", str(out)])
    assert code == 0
    _, records = _read(out / "train_step.csv")
    assert [r["row"] for r in records] == rows
    for r in records:
        assert r["status"] == "ok" and r["note"] == "", r
        assert r["backend"] == "xla" and float(r["ms"]) > 0
    assert [r["kl_mode"] for r in records] == ["", "sparse", "dense", "dense"]
    assert [r["query_stride"] for r in records] == ["", "2", "2", "2"]
    assert all(r["kl_share"] != "" for r in records[1:3]) and records[3]["kl_share"] == ""
    assert "dense_warmup_config" in records[3]["impl"]


@pytest.mark.slow
def test_breakdown_forces_a_workload_on_each_variant(tmp_path, cpu_env):
    """breakdown_prefill --workload coherent: the selected stage on the forced selection, once
    per variant (here the selected kernel's token tiles), in Pallas' interpreter."""
    from bench import breakdown_prefill

    code = breakdown_prefill.main([
        "--device", "cpu", "--preset", "tiny", "--dv", "16", "--S_list", "128", "--iters", "1",
        "--repeats", "1", "--warmup", "0", "--rotate", "1", "--dtype", "float32",
        "--stages", "selected", "--workload", "coherent",
        "--variants", "base;t4:selected.tokens_fwd=4,selected.tokens_dq=4", "--out",
        str(tmp_path)])
    assert code == 0
    _, rows = _read(tmp_path / "breakdown.csv")
    assert sorted((r["variant"], r["pass"]) for r in rows) == [
        ("base", "fwd"), ("base", "fwd_bwd"), ("t4", "fwd"), ("t4", "fwd_bwd")]
    assert all(r["status"] == "ok" and r["workload"] == "coherent" for r in rows), rows


@pytest.mark.parametrize("what,extra", [
    ("selected", ["--tiles", "default"]), ("selected", ["--tiles", "per_token"]),
    ("selected", ["--tiles", "stacked", "--workload", "coherent"]), ("decode", ["--B", "2"]),
    ("fa3", [])])
def test_profile_once_cpu_smoke(cpu_env, capsys, what, extra):
    """The call `bench/profile_once.py` hands to Nsight Compute runs on a CPU (no profiler
    there); FA-3 says it is skipped."""
    from bench import profile_once

    code = profile_once.main([what, "--S", "64", "--H", "4", "--G", "2", "--d_model", "32",
                              *TINY_NSA[:-1], *extra])
    out = capsys.readouterr().out
    assert code == 0
    assert ("skipped: flash_attn3_jax" in out) if what == "fa3" else \
        f"profiled one call of {what} (S 64" in out


def test_profile_once_rejects_bad_arguments():
    from bench import profile_once

    with pytest.raises(ValueError, match="--tiles"):
        profile_once.parse_args(["fa3", "--tiles", "stacked", "--device", "cpu"])
    with pytest.raises(ValueError, match="--B"):
        profile_once.parse_args(["decode", "--B", "0", "--device", "cpu"])
    with pytest.raises(SystemExit):
        profile_once.parse_args(["window", "--device", "cpu"])
