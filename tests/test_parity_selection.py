"""parity.selection: a differing block_idx row is a near-tie only when the blocks that differ
score within the dtype's margin of the n-th best; anything else is wrong. And the sweep's
summary reads a report back."""
import math

import numpy as np
import pytest

from nsa_common import NSAConfig
from parity.selection import Importance, classify, margin_for
from parity.sweep import CPU_CELLS, GPU_CELLS, main as sweep_main, summarise, worst_ratio


def _importance(scores):
    """One row (b=1, t=1, g=1) over blocks with the given scores and Z = 1."""
    score = np.asarray(scores, np.float64)[None, None, None]
    return Importance(score, np.ones((1, 1, 1)))


def test_equal_rows_and_ties():
    imp = _importance([math.inf, 1.0, 0.5, 0.5 * (1 - 1e-3), 0.1])
    reference = np.array([[[[0, 1, 2]]]])
    assert classify(reference, reference, imp, "bfloat16").equal == 1
    swapped = np.array([[[[0, 1, 3]]]])                     # block 3 is 0.1% below block 2
    verdict = classify(swapped, reference, imp, "bfloat16")
    assert (verdict.near_tie, verdict.wrong) == (1, 0) and verdict.passed
    assert verdict.tie_mask.tolist() == [[True]]
    # The same swap is no tie in float32, whose margin is 2^16 times narrower.
    assert classify(swapped, reference, imp, "float32").wrong == 1


def test_wrong_rows():
    imp = _importance([math.inf, 1.0, 0.5, 0.49, 0.1, -math.inf])
    reference = np.array([[[[0, 1, 2]]]])
    for bad in ([0, 1, 4], [1, 2, 3], [0, 1, 5], [0, 1, 9]):   # worse, forced dropped, ineligible
        verdict = classify(np.array([[[bad]]]), reference, imp, "bfloat16")
        assert verdict.wrong == 1 and not verdict.passed and verdict.wrong_mask.tolist() == [[True]]


def test_margin_follows_the_dtype():
    assert margin_for("bfloat16") == pytest.approx(8 * 2.0 ** -8)
    assert margin_for("float16") < margin_for("bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        margin_for("int8")


def _report(passed=True):
    rows = [
        {"section": "selection", "name": "prefill block_idx: wrong rows", "jax": 0, "torch": 0,
         "plain": math.nan, "limit": 0.0, "passed": True, "cross": math.nan,
         "cross_limit": math.nan,
         "detail": "jax: 90 equal, 10 near-tie, 0 wrong of 100 rows (worst gap 0.01 margins); "
                   "torch: 95 equal, 5 near-tie, 0 wrong of 100 rows (worst gap 0.01 margins)"},
        {"section": "shared", "name": "y", "jax": 1e-3, "torch": 2e-3, "plain": 2e-3,
         "limit": 4e-3, "passed": passed, "cross": 1e-3, "cross_limit": math.inf, "detail": ""},
    ]
    return {"rows": rows, "passed": passed, "devices": {"jax": "cpu:0"}}


def test_sweep_summarises_a_report():
    record = summarise(3, CPU_CELLS[1], _report(), 12.0)
    assert record["verdict"] == "PASS" and record["worst_ratio"] == 0.5
    assert (record["layer_equal"], record["layer_near_tie"], record["layer_wrong"]) == (90, 10, 0)
    assert worst_ratio(_report()["rows"]) == (0.5, "shared/y")
    assert summarise(0, CPU_CELLS[0], None, 1.0, "timeout")["verdict"].startswith("ERROR")
    assert {c.preset for c in GPU_CELLS} == {"tiny", "paper", "bench"}
    assert {c.dtype for c in GPU_CELLS} == {"float32", "bfloat16", "float16"}
    assert {c.torch for c in GPU_CELLS} == {"sdpa", "triton", "fa2"}


def test_sweep_cli_lists_and_rejects(capsys):
    assert sweep_main(["--list", "--device", "gpu"]) == 0
    assert "paper T=8192" in capsys.readouterr().out
    assert sweep_main(["--cells", "99"]) == 2
