"""bench/fla_agreement.py: our fla-configuration core against fla-org's `parallel_nsa`.

The comparison itself needs fla (fla-core / flash-linear-attention, not a project dependency:
it skips when fla is not importable) and, without CUDA, Triton's interpreter, which has to be
switched on before triton is first imported (set here, at collection, as in
test_torch_triton_selection.py). On a CUDA machine it skips: the GPU run is the runner's
`fla_agreement` step. The helpers (set comparison of selections, relative L2, the shape checks)
are tested everywhere.
"""
import csv
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import fla_agreement as fa  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
# The smallest sizes fla accepts (h = 16, d 16) with a real choice of blocks: 8 selection blocks
# of 8 tokens, 3 forced of 4, so queries from block 4 on choose one of blocks 1 .. i_t - 2.
TINY = ["--device", "cpu", "--S_list", "64", "--H", "16", "--G", "1", "--dk", "16", "--dv", "16",
        "--l_sel", "8", "--n_sel", "4", "--w", "16", "--dtypes", "float32"]


def test_selection_agreement_compares_sets():
    ours = torch.tensor([[[[0, 2, 3, -1]], [[0, 1, 4, 5]], [[0, 1, 2, 3]]]])      # [1, 3, 1, 4]
    fla = torch.tensor([[[[3, -1, 0, 2]], [[5, 4, 0, 2]], [[3, 2, 1, 0]]]])       # score order
    rows, blocks = fa.selection_agreement(ours, fla)
    assert rows == pytest.approx(2 / 3)             # the middle row has 2 where we have 1
    assert blocks == pytest.approx(10 / 11)         # 11 selected blocks of ours, 10 found


def test_rel_l2():
    ref = torch.tensor([3.0, 4.0])
    assert fa.rel_l2(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx((0.1, 0.5))
    rel, _ = fa.rel_l2(torch.tensor([float("nan"), 4.0]), ref)
    assert rel != rel  # NaN: never a pass
    assert fa.verdict(rel, 1e-5, True).startswith("fail")


@pytest.mark.parametrize("flags, message", [
    (["--H", "8", "--G", "1"], "power of two >= 16"),
    (["--n_sel", "12"], "n_sel (12) must be a power of two"),
    (["--l_sel", "16", "--n_sel", "16"], "l_sel (16) must be >= 2 * n_sel (32)"),
    (["--dk", "320"], "d_k, d_v <= 256"),
])
def test_rejects_shapes_fla_cannot_match(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.parse_args(flags)


@pytest.mark.skipif(not INTERPRETER, reason="Triton's interpreter is off (a CUDA machine: the "
                                            "runner's fla_agreement step runs it on the GPU)")
def test_agrees_with_fla_parallel_nsa(tmp_path, monkeypatch, capsys):
    pytest.importorskip("fla.ops.nsa", reason="fla (fla-core) is not installed")
    # main() sets these for its process; leave the session's environment as it was.
    for key, value in (("JAX_PLATFORMS", "cpu"), ("TRITON_INTERPRET", "1"),
                       ("TRITON_F32_DEFAULT", "ieee")):
        monkeypatch.setenv(key, os.environ.get(key, value))
    assert fa.main(TINY + ["--out", str(tmp_path)]) == 0
    assert "selection" in capsys.readouterr().out
    with open(tmp_path / "fla_agreement.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["selection"], r["what"]) for r in rows] == [
        (s, w) for s in fa.SELECTIONS for w in fa.QUANTITIES]
    for row in rows:
        assert row["status"] == "ok", row
        assert float(row["rel_l2"]) <= float(row["tol"]), row
        assert row["verdict"] == "pass", row
    own = [r for r in rows if r["selection"] == "own"]
    # float32, same selection rule: every (t, kv head) row selects the same blocks.
    assert all(float(r["selection_agreement"]) == 1.0 for r in own)
