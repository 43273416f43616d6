"""scripts/triton_selection_ptx.py: the Triton selection kernels compile to sm90 PTX on a host
without a GPU (the evidence behind refactors of their Python), the same tree gives the same PTX,
a changed file is reported, and `--arch sm89` compiles for an RTX 4090 within its shared
memory."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "triton_selection_ptx.py")


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="0")   # compile, not interpret
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_ptx_of_the_selection_kernels(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    proc = _run(first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(f for f in os.listdir(first) if f.endswith(".ptx"))
    # 3 kernels x (2 shapes x plain / packed + 1 shape plain)
    assert len(files) == 15 and (first / "shared.csv").is_file()
    for name in ("_sel_fwd_kernel", "_sel_bwd_dq_kernel", "_sel_bwd_dkdv_kernel"):
        ptx = (first / next(f for f in files if f.endswith(f"{name}.ptx"))).read_text()
        assert f".entry {name}" in ptx and ".target sm_90" in ptx and ".loc" not in ptx
        assert "$L__tmp" not in ptx
    proc = _run(second, "--compare", first)
    assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    (first / files[0]).write_text((first / files[0]).read_text() + "\n// changed")
    proc = _run(second, "--compare", first)
    assert proc.returncode == 1 and f"differs: {files[0]}" in proc.stdout


def test_ptx_for_sm89(tmp_path):
    proc = _run(tmp_path, "--arch", "sm89")
    assert proc.returncode == 0 and "sm89" in proc.stdout, proc.stderr[-3000:]
    ptx = next(tmp_path.glob("*_sel_fwd_kernel.ptx")).read_text()
    assert ".target sm_89" in ptx
    shared = [int(line.split(",")[1]) for line in
              (tmp_path / "shared.csv").read_text().splitlines()[1:]]
    assert len(shared) == 15 and max(shared) <= 101_376   # sm89's shared memory per block
