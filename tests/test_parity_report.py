"""The parity report passes on the default preset and fails, naming the right rows, when a weight
differs on one side only; weights round-trip bit-exactly between the frameworks."""
import jax
import numpy as np
import pytest
import torch

import nsa_jax
import nsa_torch_ref
from nsa_common import NSAConfig
from nsa_torch_ref.module import flatten_params as _flatten
from parity.__main__ import main
from parity.convert import module_to_params, params_to_module
from parity.report import ParitySettings, run_report


# Every report of this module runs at one size, so that its JAX programs compile once: a later
# report's are served by the compilation cache.
SEQ_LEN, DECODE_STEPS = 56, 2


def _settings(**changes) -> ParitySettings:
    return ParitySettings(cfg=NSAConfig.tiny(), seq_len=SEQ_LEN, decode_steps=DECODE_STEPS,
                          **changes)


def _by_name(rows, section=None):
    return {row.name: row for row in rows if section is None or row.section == section}


@pytest.fixture(scope="module")
def default_rows():
    return run_report(_settings(), progress=False)


def test_report_passes_on_default_preset(default_rows):
    failed = [f"{row.section}/{row.name}" for row in default_rows if not row.passed]
    assert not failed
    sections = {row.section for row in default_rows}
    assert sections == {"selection", "shared", "own", "stage", "decode"}
    shared = _by_name(default_rows, "shared")
    for expected in ("o_cmp", "o_sel", "o_win", "gates", "y", "d x", "d wq", "d cmp_v.w1",
                     "prefill y", "decode y (2 steps)", "ragged decode y (2 steps)"):
        assert expected in shared
    stages = _by_name(default_rows, "stage")
    for expected in ("q", "k win", "v sel", "gates (stage)", "compress k", "selected_attention",
                     "output (gated sum, wo)", "select_blocks: wrong rows"):
        assert expected in stages
    assert shared["y"].jax < 1e-5 and shared["y"].limit < 1e-5  # float32: limits near u
    assert "decode block_idx: wrong rows" in _by_name(default_rows, "selection")


def test_decode_rows_run_on_the_chosen_backend(monkeypatch, default_rows):
    """The decode rows hand the report's JAX backend to prefill and decode_step (so
    `--jax-backend pallas` compares the Pallas decode kernels); here the calls are recorded and
    then run on XLA, which keeps the check fast on a CPU."""
    from parity.report import _Runner

    seen = []

    def recording(fn):
        def run(*args, backend, **kwargs):
            seen.append((fn.__name__, tuple(backend)))
            return fn(*args, backend="xla", **kwargs)
        return run

    monkeypatch.setattr(nsa_jax, "prefill", recording(nsa_jax.prefill))
    monkeypatch.setattr(nsa_jax, "decode_step", recording(nsa_jax.decode_step))
    runner = _Runner(_settings(jax_backend="pallas"))
    rows = runner.decode_rows()
    expected = [(r.section, r.name) for r in default_rows
                if r.section == "decode" or "decode" in r.name or "prefill y" in r.name]
    assert [(r.section, r.name) for r in rows] == expected
    assert all(row.passed for row in rows)
    assert set(seen) == {("prefill", ("pallas", "xla")), ("decode_step", ("pallas", "xla"))}


def test_report_fails_on_the_perturbed_weight():
    rows = run_report(_settings(perturb="wk.win"), progress=False)
    failed = {(r.section, r.name) for r in rows if not r.passed}
    # The stage that reads wk.win places the fault; the other projections agree.
    assert ("stage", "k win") in failed and ("shared", "o_win") in failed
    assert ("stage", "k sel") not in failed and ("stage", "q") not in failed
    assert ("stage", "sliding_window_attention") not in failed


def test_cli_exit_codes(capsys):
    assert main(["--T", str(SEQ_LEN), "--decode-steps", str(DECODE_STEPS),
                 "--perturb", "wo"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "output (gated sum, wo)" in out
    assert main(["--preset", "nope"]) == 2
    assert main(["--jax-backend", "nope", "--T", "8", "--decode-steps", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["--plant", "no_such_bug"])


@pytest.mark.parametrize("cfg", [NSAConfig.tiny(), NSAConfig.tiny(compress="mean", shared_kv=True)],
                         ids=["mlp", "mean-shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_round_trip_bit_exact(cfg, dtype):
    torch.manual_seed(0)
    module = nsa_torch_ref.NSAAttention(cfg).to(dtype)
    params = module_to_params(module)
    expected = jax.tree_util.tree_map(lambda s: s, nsa_jax.param_shapes(cfg),
                                      is_leaf=lambda s: isinstance(s, tuple))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda s: 0, expected, is_leaf=lambda s: isinstance(s, tuple)))
    torch.manual_seed(1)
    other = nsa_torch_ref.NSAAttention(cfg).to(dtype)
    params_to_module(params, other)
    for (name, a), (_, b) in zip(module.named_parameters(), other.named_parameters()):
        assert torch.equal(a.view(torch.int16) if dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if dtype == torch.bfloat16 else b), name
    again = _flatten(module_to_params(other))
    for name, value in _flatten(params).items():
        np.testing.assert_array_equal(np.asarray(again[name]).view(np.uint8),
                                      np.asarray(value).view(np.uint8))


def test_params_to_module_names_the_mismatch():
    module = nsa_torch_ref.NSAAttention(NSAConfig.tiny())
    params = module_to_params(module)
    del params["wk"]["win"]
    with pytest.raises(ValueError, match="wk.win"):
        params_to_module(params, module)


@pytest.mark.slow
def test_bfloat16_report_passes_at_T_1024():
    """The size people train at, in bfloat16: every row passes (near-tie selections, exactly
    zero gradients and long reductions judged by what they should be)."""
    rows = run_report(ParitySettings(cfg=NSAConfig.tiny(), batch=2, seq_len=1024,
                                     dtype="bfloat16"), progress=False)
    assert [f"{r.section}/{r.name}" for r in rows if not r.passed] == []
    selection = _by_name(rows, "selection")["prefill block_idx: wrong rows"]
    assert "near-tie" in selection.detail
