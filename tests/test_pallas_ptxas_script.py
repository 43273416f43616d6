"""scripts/pallas_ptxas.py: a Pallas kernel lowered for CUDA on a CPU host, its TTIR compiled
by the installed Triton for sm90 (or `--arch`), and ptxas's registers, spills and shared memory
reported; the decode and window kernels too."""
import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pallas_ptxas.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


def test_selection_kernel_registers_and_shared_memory(tmp_path):
    rows = {}
    for label, extra in (("default", []), ("narrow", ["--set", "block_sel=16,num_stages=2"])):
        path = tmp_path / f"{label}.csv"
        proc = _run("select", "--S", 2048, "--csv", path, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        (rows[label],) = list(csv.DictReader(open(path)))
        assert "kernel=nsa_select_blocks" in proc.stdout
    default, narrow = rows["default"], rows["narrow"]
    assert default["status"] == "ok" and (default["num_warps"], default["num_stages"]) == ("4", "3")
    assert 0 < int(default["registers"]) <= 255 and int(default["spill_stores"]) >= 0
    # the narrow step: half the compressed keys a stage, one stage fewer
    assert narrow["num_stages"] == "2"
    assert 0 < int(narrow["shared_bytes"]) < int(default["shared_bytes"])


def test_unknown_block_size_field_is_named():
    proc = _run("select", "--set", "block_size=64")
    assert proc.returncode == 2 and "block_size" in proc.stderr and "block_sel" in proc.stderr
    proc = _run("select", "--set", "block_sel")
    assert proc.returncode == 2 and "field=value" in proc.stderr


def test_decode_kernels_for_sm89(tmp_path):
    path = tmp_path / "decode.csv"
    proc = _run("decode", "--arch", "sm89", "--S", 1024, "--csv", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(path)))
    names = {row["kernel"] for row in rows}
    assert {"nsa_decode_compressed", "nsa_decode_select", "nsa_select_top_n",
            "nsa_decode_selected_window", "nsa_decode_combine", "nsa_decode_append"} <= names
    for row in rows:
        assert row["arch"] == "sm89" and row["shared_limit"] == "101376"
        assert row["status"] == "ok" and row["fits"] == "True", row


def test_unknown_arch_is_named():
    proc = _run("select", "--arch", "sm75")
    assert proc.returncode == 2 and "sm75" in proc.stderr and "sm89" in proc.stderr


def test_window_kernels_fit_sm80_and_sm89(tmp_path):
    """The window kernels (forward, dq, dk/dv) at d_k 128 and the paper's 192 (d_v 128), on the
    sm80 and sm89 profiles' tiles: within shared memory, a few hundred bytes of spills at most."""
    path = tmp_path / "window.csv"
    proc = _run("window", "--arch", "sm80,sm89", "--heads", "128/128,192/128", "--S", 1024,
                "--csv", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(path)))
    assert sorted({(r["arch"], r["d_k"]) for r in rows}) == [
        ("sm80", "128"), ("sm80", "192"), ("sm89", "128"), ("sm89", "192")]
    assert {r["kernel"] for r in rows} == {"nsa_window_attention_fwd", "nsa_window_attention_dq",
                                           "nsa_window_attention_dkv"}
    assert len(rows) == 12
    for row in rows:
        label = f"{row['arch']} d_k {row['d_k']} {row['kernel']}"
        assert row["status"] == "ok" and row["fits"] == "True", label
        assert int(row["shared_bytes"]) <= int(row["shared_limit"]), label
        assert int(row["spill_stores"]) <= 256, (label, row["spill_stores"])
