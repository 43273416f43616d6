"""The parity report passes on the default preset, and fails, naming the right rows, when a
weight differs on one side only; weights round-trip bit-exactly between the frameworks."""
import jax
import numpy as np
import pytest
import torch

import nsa_jax
import nsa_torch_ref
from nsa_common import NSAConfig
from parity.__main__ import main
from nsa_torch_ref.module import flatten_params as _flatten
from parity.convert import module_to_params, params_to_module
from parity.report import ParitySettings, run_report


def _by_name(rows):
    return {row.name: row for row in rows}


@pytest.fixture(scope="module")
def default_rows():
    return run_report(ParitySettings(cfg=NSAConfig.tiny(), seq_len=56, decode_steps=2),
                      progress=False)


def test_report_passes_on_default_preset(default_rows):
    failed = [row.name for row in default_rows if not row.passed]
    assert not failed
    names = _by_name(default_rows)
    for expected in ("o_cmp", "o_sel", "o_win", "gates", "y", "block_idx agreement", "d x",
                     "d wq", "d cmp_v.w1", "prefill y", "decode reads (equal, <= bound)",
                     "selected_attention (shared block_idx)"):
        assert expected in names
    assert names["y"].error < 1e-5


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
    runner = _Runner(ParitySettings(cfg=NSAConfig.tiny(), seq_len=56, decode_steps=2,
                                    jax_backend="pallas"))
    rows = runner.decode_rows()
    assert [row.name for row in rows] == [row.name for row in default_rows
                                          if row.section == "decode"]
    assert all(row.passed for row in rows)
    assert set(seen) == {("prefill", ("pallas", "xla")), ("decode_step", ("pallas", "xla"))}


def test_report_fails_on_the_perturbed_branch():
    rows = _by_name(run_report(ParitySettings(cfg=NSAConfig.tiny(), seq_len=40, decode_steps=1,
                                              perturb="wk.win"), progress=False))
    assert not rows["o_win"].passed and not rows["y"].passed
    # The other branches do not read wk.win and stay within tolerance; the kernel rows take
    # shared inputs, so they pass too: the report places the fault in the weights, not a kernel.
    assert rows["o_cmp"].passed and rows["o_sel"].passed
    assert rows["sliding_window_attention"].passed and rows["compressed_attention"].passed


def test_cli_exit_codes(capsys):
    assert main(["--T", "24", "--decode-steps", "1", "--perturb", "wo"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "y " in out
    assert main(["--preset", "nope"]) == 2
    assert main(["--jax-backend", "nope", "--T", "8", "--decode-steps", "0"]) == 2


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
