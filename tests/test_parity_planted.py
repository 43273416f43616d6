"""Proof that the parity report's leniency hides no bug: a 1% change of any weight on the JAX side
and each planted bug of `parity.bugs` make it FAIL, in float32 and bfloat16, at T 80 (the
default run: bfloat16 and a representative subset; CI's slow run: everything, and T 1024).
The PyTorch side and the float64 reference are computed once per setting; only JAX reruns."""
import jax
import pytest

from nsa_common import NSAConfig
from nsa_torch_ref.module import flatten_params, nest_params
from parity.bugs import BUGS, planted
from parity.report import ParitySettings, _Runner

PARAMS = tuple(flatten_params(__import__("nsa_jax").param_shapes(NSAConfig.tiny())))
QUICK_PARAMS = ("wq", "wk.win", "bg", "cmp_k.pos", "cmp_v.b1")
QUICK_BUGS = ("worse_blocks",)

_RUNNERS = {}


def runner(dtype: str, T: int) -> _Runner:
    if (dtype, T) not in _RUNNERS:
        with jax.default_matmul_precision("highest"):
            _RUNNERS[(dtype, T)] = _Runner(ParitySettings(
                cfg=NSAConfig.tiny(), batch=1, seq_len=T, dtype=dtype, decode_steps=0))
    return _RUNNERS[(dtype, T)]


def failing(r: _Runner) -> list[str]:
    with jax.default_matmul_precision("highest"):
        return [f"{row.section}/{row.name}" for row in r.jax_rows() if not row.passed]


def _settings(quick, full):
    """(dtype, T, name) cases: the quick ones by default, the rest marked slow."""
    cases = []
    for dtype in ("bfloat16", "float32"):
        for T in (80, 1024):
            for name in full:
                fast = dtype == "bfloat16" and T == 80 and name in quick
                cases.append(pytest.param(dtype, T, name, marks=() if fast else pytest.mark.slow,
                                          id=f"{dtype}-{T}-{name}"))
    return cases


@pytest.mark.parametrize("dtype,T", [("bfloat16", 80), pytest.param("float32", 80,
                                                                    marks=pytest.mark.slow),
                                     pytest.param("bfloat16", 1024, marks=pytest.mark.slow),
                                     pytest.param("float32", 1024, marks=pytest.mark.slow)])
def test_clean_run_passes(dtype, T):
    assert failing(runner(dtype, T)) == []


@pytest.mark.parametrize("dtype,T,name", _settings(QUICK_PARAMS, PARAMS))
def test_one_percent_on_any_weight_fails(dtype, T, name):
    r = runner(dtype, T)
    clean = r.params
    flat = flatten_params(clean)
    try:
        r.params = nest_params({**flat, name: flat[name] * 1.01})
        assert failing(r), f"a 1% change of {name} went unseen"
    finally:
        r.params = clean


@pytest.mark.parametrize("dtype,T,name", _settings(QUICK_BUGS, tuple(BUGS)))
def test_planted_bug_fails(dtype, T, name):
    r = runner(dtype, T)
    with planted(name):
        assert failing(r), f"planted bug {name} ({BUGS[name]}) went unseen"
    assert failing(r) == []  # the patch is gone with the context
