"""`nsa_torch_ref.dispatch`: ordered fallbacks. A backend that cannot serve an input raises
NotImplementedError and the next one of the caller's choice runs; when none is left,
NoBackendError names every reason. Backends here are stand-ins; the real kernels are tested in
test_torch_fa2.py and test_torch_triton_selection.py."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from nsa_common import NSAConfig
from nsa_torch_ref import NSAAttention, dispatch, reference
from nsa_torch_ref.fast import routing, runtime

CFG = NSAConfig.tiny()
BRANCH = "sliding_window_attention"


@pytest.fixture
def scratch(monkeypatch):
    """Registrations made by a test disappear after it; no NSA_* toggle set."""
    monkeypatch.setattr(dispatch, "_TABLE", copy.deepcopy(dispatch._TABLE))
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)
    monkeypatch.delenv("NSA_PROFILE", raising=False)
    runtime.reset_log_counts()
    return monkeypatch


def refusing(reason: str):
    def backend(*args, **kwargs):
        raise dispatch.Unsupported(reason)
    return backend


def window_inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 20, CFG.n_heads, CFG.d_k, generator=gen)
    k = torch.randn(1, 20, CFG.n_kv_heads, CFG.d_k, generator=gen)
    v = torch.randn(1, 20, CFG.n_kv_heads, CFG.d_v, generator=gen)
    return q, k, v


def test_a_refusing_backend_falls_through_to_the_next(scratch):
    dispatch.register(BRANCH, "picky", refusing("takes float16 only"))
    q, k, v = window_inputs()
    heard = []
    out = dispatch.call(BRANCH, ("picky", "sdpa"), q, k, v, CFG.window,
                        on_refusal=lambda name, error: heard.append((name, str(error))))
    assert torch.equal(out, reference.sliding_window_attention(q, k, v, CFG.window))
    assert heard == [("picky", "takes float16 only")]


def test_no_backend_left_names_every_reason(scratch):
    dispatch.register(BRANCH, "picky", refusing("takes float16 only"))
    dispatch.register(BRANCH, "fussy", refusing("needs CUDA"))
    q, k, v = window_inputs()
    with pytest.raises(dispatch.NoBackendError,
                       match=r"\['picky', 'fussy'\].*'picky': takes float16 only; "
                             r"'fussy': needs CUDA") as caught:
        dispatch.call(BRANCH, ("picky", "fussy"), q, k, v, CFG.window)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, NotImplementedError)
    # A single name never silently changes path.
    with pytest.raises(dispatch.NoBackendError, match="takes float16 only"):
        dispatch.call(BRANCH, "picky", q, k, v, CFG.window)


def test_other_errors_are_not_fallbacks(scratch):
    def broken(*args, **kwargs):
        raise ValueError("window (0) must be a positive int")

    dispatch.register(BRANCH, "broken", broken)
    with pytest.raises(ValueError, match="positive int"):
        dispatch.call(BRANCH, ("broken", "sdpa"), *window_inputs(), CFG.window)


def test_choices_are_validated(scratch):
    for bad in ((), ("sdpa", 3)):
        with pytest.raises(ValueError, match="name or a non-empty sequence"):
            dispatch.backend_names(BRANCH, bad)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        NSAAttention(CFG, backends={BRANCH: ("sdpa", "nope")})


def test_layer_runs_the_ordered_choice(scratch):
    dispatch.register(BRANCH, "picky", refusing("takes float16 only"))
    torch.manual_seed(0)
    layer = NSAAttention(CFG, backends={BRANCH: ("picky", "sdpa")})
    plain = NSAAttention(CFG)
    plain.load_state_dict(layer.state_dict())
    assert layer.backends[BRANCH] == ("picky", "sdpa")
    x = torch.randn(1, 20, CFG.d_model)
    assert torch.equal(layer(x), plain(x))
    alone = NSAAttention(CFG, backends={BRANCH: "picky"})
    with pytest.raises(dispatch.NoBackendError, match="takes float16 only"):
        alone(x)


def test_auto_falls_back_to_the_reference_and_logs_it(scratch, caplog):
    """The toggles choose a kernel that then refuses the call: "auto" runs the reference."""
    dispatch.register("selected_attention", routing.TRITON, refusing("q dtype torch.float32"))
    scratch.setenv("NSA_TRITON_SEL_FORCE", "1")
    scratch.setenv("TRITON_INTERPRET", "1")  # Triton counts as usable on a CPU
    scratch.setenv("NSA_DEBUG_LOG", "1")
    torch.manual_seed(0)
    auto = NSAAttention(CFG, backends={"selected_attention": routing.AUTO})
    plain = NSAAttention(CFG)
    plain.load_state_dict(auto.state_dict())
    x = torch.randn(1, 20, CFG.d_model)
    with caplog.at_level(logging.WARNING, logger="nsa_torch_ref"):
        y = auto(x)
    assert torch.equal(y, plain(x))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "selected_attention -> triton" in messages
    assert "triton refused the call (q dtype torch.float32)" in messages


def test_the_layer_selects_and_compresses_through_the_dispatch(scratch):
    """`select_blocks` and `compress_kv` are dispatch entries: a backend registered for them is
    the one the layer runs (here one that keeps only the forced blocks changes o_sel, and one
    that refuses falls through to the reference)."""
    torch.manual_seed(0)
    x = torch.randn(1, 40, CFG.d_model)
    plain = NSAAttention(CFG)
    _, aux = plain(x, return_aux=True)

    def forced_only(q, k_cmp, cfg):
        block_idx = reference.select_blocks(q, k_cmp, cfg)
        return torch.where(block_idx == 0, block_idx, torch.full_like(block_idx, -1))

    dispatch.register("select_blocks", "forced_only", forced_only)
    dispatch.register("compress_kv", "picky", refusing("takes float16 only"))
    layer = NSAAttention(CFG, backends={"select_blocks": "forced_only",
                                        "compress_kv": ("picky", "sdpa")})
    layer.load_state_dict(plain.state_dict())
    _, aux_forced = layer(x, return_aux=True)
    assert torch.equal(aux_forced["o_cmp"], aux["o_cmp"])
    assert torch.equal(aux_forced["o_win"], aux["o_win"])
    assert torch.equal(aux_forced["block_idx"], torch.where(
        aux["block_idx"] == 0, aux["block_idx"], torch.full_like(aux["block_idx"], -1)))
    assert not torch.allclose(aux_forced["o_sel"], aux["o_sel"])
    with pytest.raises(ValueError, match="unknown backend 'nope' for 'select_blocks'"):
        NSAAttention(CFG, backends={"select_blocks": "nope"})


@pytest.mark.parametrize("shared", [False, True])
def test_the_core_is_the_layer_between_projections_and_output(shared):
    """`native_sparse_attention` on the layer's projections and gates gives the layer's output
    before `wo` (and its aux), with per-branch dicts or one shared K/V."""
    from nsa_torch_ref.module import gate_values, native_sparse_attention, project
    cfg = NSAConfig.tiny(shared_kv=shared) if shared else CFG
    torch.manual_seed(1)
    layer = NSAAttention(cfg).double()
    x = torch.randn(2, 37, cfg.d_model, dtype=torch.float64)
    y, aux = layer(x, return_aux=True)
    params = layer.param_tree()
    q, k, v = project(params, x, cfg, torch.arange(37))
    logits = (x @ params["wg"] + params["bg"]).reshape(2, 37, cfg.n_heads, 3)
    kv = (k["sel"], v["sel"]) if shared else (k, v)
    o, core = native_sparse_attention(q, *kv, logits, cfg, cmp_params=params,
                                      gates_are_logits=True, return_aux=True)
    assert torch.equal(core["gates"], gate_values(params, x, cfg))
    for key in ("o_cmp", "o_sel", "o_win", "block_idx"):
        assert torch.equal(core[key], aux[key]), key
    torch.testing.assert_close(o.reshape(2, 37, -1) @ params["wo"], y, rtol=0, atol=1e-12)
    if cfg.compress == "mlp":
        with pytest.raises(ValueError, match="cmp_params"):
            native_sparse_attention(q, *kv, logits, cfg)
