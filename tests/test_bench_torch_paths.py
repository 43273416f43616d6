"""bench/bench_torch_paths.py on CPU: the smoke run's CSV / PNG / JSON, the inputs it builds, the
fa2 kernel probe, and the threshold rule on hand-made records (no timing claims).

Without CUDA the Triton path runs in Triton's interpreter, which has to be switched on before
triton is first imported: TRITON_INTERPRET=1 is set here, at collection, as in
test_torch_triton_selection.py.
"""
import csv
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from bench import bench_torch_paths as btp  # noqa: E402
from bench import common  # noqa: E402
from nsa_common import NSAConfig  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
TOL_F32 = 1e-4  # Triton (float32, ieee dots) against the float32 reference, output and gradients
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T_LIST = (8, 16)
TINY = ["--device", "cpu", "--T_list", ",".join(map(str, T_LIST)), "--H", "2", "--G", "1",
        "--dk", "16", "--dv", "16", "--l", "8", "--d", "4", "--l_sel", "16", "--n_sel", "3",
        "--w", "16", "--dtype", "float32", "--iters", "1", "--repeats", "1", "--warmup", "0",
        "--rotate", "1", "--max_call_s", "600", "--no_progress"]


def _read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETER, reason="Triton's interpreter is off (a CUDA machine)")
def test_cpu_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMMIT", "testcommit")
    out = tmp_path / "bench"
    assert btp.main(TINY + ["--out", str(out)]) == 0

    columns, records = _read(out / "torch_paths.csv")
    assert columns == btp.COLUMNS
    by = {(r["branch"], r["path"], r["pass"], int(r["T"])): r for r in records}
    expected = {(branch, path, p, T) for branch in btp.BRANCHES
                for path in (btp.REFERENCE_PATH, btp.FAST_PATHS[branch])
                for p in btp.PASSES for T in T_LIST}
    assert set(by) == expected and len(records) == len(expected)
    for (branch, path, p, T), r in by.items():
        if path == "fa2":  # no CUDA: the call would run the reference, so it is not timed
            assert r["status"] == "skipped", r
            assert r["note"].startswith("skipped: fa2 would run the reference")
            assert "CUDA" in r["note"]
            assert r["ms"] == "" and r["speedup"] == ""
            continue
        assert r["status"] == "ok", r
        assert 0 < float(r["ms_min"]) <= float(r["ms"]) <= float(r["ms_max"])
        if path == btp.REFERENCE_PATH:
            assert r["kernel"] == "reference" and r["rel_err"] == "" and r["speedup"] == ""
        else:
            assert r["kernel"] == "triton (interpreter)"
            assert float(r["rel_err"]) < TOL_F32 and float(r["rel_err_grad"]) < TOL_F32
            ref = by[(branch, btp.REFERENCE_PATH, p, T)]
            assert float(r["speedup"]) == pytest.approx(float(ref["ms"]) / float(r["ms"]),
                                                        rel=1e-4)

    with open(out / "torch_paths.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC
    thresholds = json.loads((out / "torch_paths_thresholds.json").read_text())
    assert set(thresholds["thresholds"]) == set(btp.THRESHOLD_KEYS.values())
    # FA-2 never ran; interpreted Triton is far slower than the reference.
    assert thresholds["thresholds"] == {key: None for key in btp.THRESHOLD_KEYS.values()}
    assert thresholds["details"]["sel"]["verdicts"] == {str(T): "lose" for T in T_LIST}
    assert thresholds["tolerance"] == TOL_F32 and thresholds["T_list"] == list(T_LIST)
    env = json.loads((out / "torch_paths_env.json").read_text())
    assert env["commit"] == "testcommit"

    # The recommendation comes last, after the summary table.
    printed = capsys.readouterr().out
    tail = printed[printed.index("recommended thresholds"):]
    assert "sdpa_fwd_ms" in printed[:printed.index("recommended thresholds")]
    assert [line.split(":")[0].strip() for line in tail.splitlines()[1:4]] == [
        "sel_triton_min_l", "fa2_min_len_win", "fa2_min_len_cmp"]


def test_fa2_probe_sees_the_reference_fallback_and_restores():
    from nsa_torch_ref import dispatch
    from nsa_torch_ref.fast import fa2

    cfg = NSAConfig(n_heads=2, n_kv_heads=1, d_k=16, d_v=16, cmp_block=8, cmp_stride=4,
                    sel_block=16, n_sel=3, window=16)
    q = torch.randn(1, 20, 2, 16)
    k_cmp, v_cmp = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    original = fa2._compressed_reference
    with btp.fa2_kernels_run() as ran:
        out = dispatch.resolve("compressed_attention", "fa2")(q, k_cmp, v_cmp, cfg)
    assert ran == ["reference"]  # CPU tensors: no FlashAttention kernel can take the call
    assert fa2._compressed_reference is original
    expected = dispatch.resolve("compressed_attention", "sdpa")(q, k_cmp, v_cmp, cfg)
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------
# The threshold rule on hand-made records
# ---------------------------------------------------------------------------------------------
TOL = 1e-2


def _records(branch, table, rel_err=1e-3, status=None):
    """table {T: (sdpa fwd, fast fwd, sdpa fwd_bwd, fast fwd_bwd) ms}; rel_err a number or
    {T: number}; status {(path, pass, T): status} overrides "ok" (and drops the time)."""
    fast_path = btp.FAST_PATHS[branch]
    status = status or {}
    records = []
    for T, (ref_fwd, fast_fwd, ref_both, fast_both) in table.items():
        for path, fwd, both in (("sdpa", ref_fwd, ref_both), (fast_path, fast_fwd, fast_both)):
            for p, ms in (("fwd", fwd), ("fwd_bwd", both)):
                r = {"branch": branch, "path": path, "pass": p, "T": T,
                     "status": status.get((path, p, T), "ok")}
                if r["status"] == "ok":
                    r["ms"] = ms
                else:
                    r["note"] = f"{r['status']}: made up"
                if path == fast_path:
                    err = rel_err[T] if isinstance(rel_err, dict) else rel_err
                    r.update(rel_err=err, rel_err_grad=err)
                records.append(r)
    return records


def _value(records, branch="sel"):
    return btp.recommend_thresholds(records, TOL)[branch]["value"]


def test_threshold_from_the_first_t_where_the_fast_path_wins_on():
    table = {256: (1.0, 2.0, 1.0, 2.0), 512: (1.0, 1.5, 1.0, 1.5), 1024: (1.0, 0.9, 1.0, 0.9),
             2048: (1.0, 0.5, 1.0, 0.5)}
    result = btp.recommend_thresholds(_records("sel", table), TOL)
    assert result["sel"]["value"] == 1024 and result["sel"]["key"] == "sel_triton_min_l"
    assert result["sel"]["verdicts"] == {"256": "lose", "512": "lose", "1024": "win",
                                         "2048": "win"}
    # Equal times count ("at least as fast").
    assert _value(_records("sel", {512: (1.0, 1.0, 2.0, 2.0), 1024: (1.0, 0.5, 1.0, 0.5)})) == 512


def test_threshold_needs_both_passes():
    # Forward wins from 512, forward+backward only from 2048.
    table = {512: (1.0, 0.9, 1.0, 1.2), 1024: (1.0, 0.8, 1.0, 1.1), 2048: (1.0, 0.7, 1.0, 0.9)}
    assert _value(_records("win", table), "win") == 2048


def test_threshold_non_monotone_takes_the_t_after_the_last_loss():
    table = {128: (1.0, 2.0, 1.0, 2.0), 256: (1.0, 0.9, 1.0, 0.9), 512: (1.0, 1.1, 1.0, 1.1),
             1024: (1.0, 0.8, 1.0, 0.8), 2048: (1.0, 0.5, 1.0, 0.5)}
    assert _value(_records("cmp", table), "cmp") == 1024


def test_threshold_null_when_never_faster_or_slower_at_the_top():
    never = {256: (1.0, 2.0, 1.0, 2.0), 1024: (1.0, 1.5, 1.0, 1.5)}
    result = btp.recommend_thresholds(_records("sel", never), TOL)["sel"]
    assert result["value"] is None and "speed-up" in result["reason"]
    loses_at_top = {256: (1.0, 0.5, 1.0, 0.5), 1024: (1.0, 1.5, 1.0, 1.5)}
    assert _value(_records("sel", loses_at_top)) is None


def test_threshold_null_when_incorrect():
    fast = {256: (1.0, 0.5, 1.0, 0.5), 1024: (1.0, 0.5, 1.0, 0.5)}
    wrong = btp.recommend_thresholds(_records("sel", fast, rel_err=0.05), TOL)["sel"]
    assert wrong["value"] is None and "wrong" in wrong["reason"]
    assert _value(_records("sel", fast, rel_err=float("nan"))) is None
    assert _value(_records("sel", fast, rel_err={256: 1e-3, 1024: 0.05})) is None
    # Wrong only at the smallest T: the threshold starts after it.
    assert _value(_records("sel", fast, rel_err={256: 0.05, 1024: 1e-3})) == 1024


def test_threshold_with_failed_cells():
    table = {512: (1.0, 0.5, 1.0, 0.5), 1024: (1.0, 0.5, 1.0, 0.5)}
    # The reference out of memory at the top: the fast path that ran there still wins (its
    # correctness was checked where the reference fits).
    ref_oom = {("sdpa", p, 1024): "oom" for p in btp.PASSES}
    records = _records("sel", table, rel_err={512: 1e-3, 1024: None}, status=ref_oom)
    assert _value(records) == 512
    # The fast path failing at the top: no threshold.
    fast_oom = {("triton", "fwd_bwd", 1024): "oom"}
    assert _value(_records("sel", table, status=fast_oom)) is None
    # Neither path ran at the top: that T is ignored.
    both_oom = {(path, p, 1024): "oom" for path in ("sdpa", "triton") for p in btp.PASSES}
    assert _value(_records("sel", table, status=both_oom)) == 512
    # A fast path that ran but was never checked against a reference that ran: not trusted.
    assert _value(_records("sel", table, rel_err={512: 1e-3, 1024: None})) is None


def test_threshold_from_csv_strings(tmp_path):
    table = {256: (1.0, 2.0, 1.0, 2.0), 1024: (1.0, 0.9, 1.0, 0.9)}
    records = []
    for branch in btp.BRANCHES:
        records += _records(branch, table)
    path = tmp_path / "records.csv"
    common.write_csv(str(path), records, btp.COLUMNS)
    result = btp.recommend_thresholds(common.read_csv(str(path)), TOL)
    assert {item["key"]: item["value"] for item in result.values()} == {
        "sel_triton_min_l": 1024, "fa2_min_len_win": 1024, "fa2_min_len_cmp": 1024}


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="T_list"):
        btp.parse_args(["--T_list", "1k,abc"])
    with pytest.raises(ValueError, match="branches"):
        btp.parse_args(["--branches", "sel,flash"])
    with pytest.raises(ValueError, match="iters"):
        btp.parse_args(["--iters", "0"])
    with pytest.raises(ValueError, match="cell_budget_s"):
        btp.parse_args(["--cell_budget_s", "0"])
    with pytest.raises(ValueError, match="n_sel"):
        btp.parse_args(["--n_sel", "2"])
