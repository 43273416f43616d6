"""Runtime toggles (nsa_torch_ref/fast/runtime.py) and routing (nsa_torch_ref/fast/routing.py).

Precedence is environment > profile > base; a malformed value names its variable. Routing is
tested on `torch.device("cuda")` objects, which need no GPU: only the decision is checked here.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from nsa_common import NSAConfig
from nsa_torch_ref import dispatch
from nsa_torch_ref.fast import routing, runtime

CUDA = torch.device("cuda")


@pytest.fixture
def env(monkeypatch):
    """A clean environment: no NSA_* toggle, no profile, no interpreter."""
    for toggle in runtime.TOGGLES:
        monkeypatch.delenv(toggle.env, raising=False)
    monkeypatch.delenv("NSA_PROFILE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    runtime.reset_log_counts()
    return monkeypatch


# ---------------------------------------------------------------------------------------------
# Toggles and precedence
# ---------------------------------------------------------------------------------------------
def test_base_defaults_and_sources(env):
    config = runtime.load(profile="base")
    assert not config.use_triton_sel and not config.use_fa2
    assert config.sel_triton_allow_grad and config.log_limit == 50
    assert set(config.sources.values()) == {"base"}
    assert config.describe("use_fa2") == "NSA_USE_FA2=0 (base)"


def test_env_beats_profile_beats_base(env):
    config = runtime.load(profile="sm90")
    assert config.use_fa2 and config.sources["use_fa2"] == "profile:sm90"
    assert config.fa2_min_len_win == 128 and config.sources["fa2_min_len_win"] == "profile:sm90"
    assert config.fa2_force_dense is False and config.sources["fa2_force_dense"] == "base"
    env.setenv("NSA_USE_FA2", "0")
    env.setenv("NSA_FA2_MIN_LEN_WIN", " 77 ")
    config = runtime.load(profile="sm90")
    assert config.use_fa2 is False and config.sources["use_fa2"] == "env"
    assert config.fa2_min_len_win == 77 and config.describe("fa2_min_len_win") == \
        "NSA_FA2_MIN_LEN_WIN=77 (env)"
    env.setenv("NSA_USE_FA2", "")  # empty means unset
    assert runtime.load(profile="sm90").sources["use_fa2"] == "profile:sm90"


def test_sm89_profile_keeps_fast_paths_off(env):
    config = runtime.load(profile="sm89")
    assert not config.use_triton_sel and not config.use_fa2
    assert config.sources["use_triton_sel"] == "profile:sm89"


@pytest.mark.parametrize("var, value, match", [
    ("NSA_FA2_MIN_LEN_WIN", "abc", r"NSA_FA2_MIN_LEN_WIN \('abc'\) must be an int"),
    ("NSA_SEL_TRITON_MIN_L", "-3", r"NSA_SEL_TRITON_MIN_L \(-3\) must be >= 0"),
    ("NSA_USE_TRITON_SEL", "maybe", r"NSA_USE_TRITON_SEL \('maybe'\) must be a boolean"),
    ("NSA_LOG_LIMIT", "1.5", "NSA_LOG_LIMIT"),
    ("NSA_PROFILE", "sm00", r"NSA_PROFILE \('sm00'\) must be one of"),
])
def test_bad_values_name_the_variable(env, var, value, match):
    env.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        runtime.load()


@pytest.mark.parametrize("raw, expected", [("1", True), ("TRUE", True), ("on", True),
                                           ("0", False), ("no", False), ("Off", False)])
def test_boolean_spellings(env, raw, expected):
    env.setenv("NSA_DEBUG_TIMING", raw)
    assert runtime.load(profile="base").debug_timing is expected


def test_profile_from_capability(env):
    for capability, name in (((8, 9), "sm89"), ((9, 0), "sm90"), ((8, 0), "base")):
        env.setattr(runtime, "cuda_capability", lambda device=None, c=capability: c)
        assert runtime.detect_profile()[0] == name
        assert runtime.load().profile == name
    env.setattr(runtime, "cuda_capability", lambda device=None: None)
    assert runtime.detect_profile() == ("base", "no CUDA device")
    env.setenv("NSA_PROFILE", "sm90")  # the environment wins over the device
    assert runtime.detect_profile()[0] == "sm90"


def test_yaml_errors_name_file_and_key(env, tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "base.yaml").write_text("use_fa2: false\nuse_fa3: true\n")
    env.setattr(runtime, "CONFIG_DIR", tmp_path)
    env.setattr(runtime, "PROFILE_DIR", tmp_path / "profiles")
    with pytest.raises(ValueError, match=r"base.yaml has unknown keys \['use_fa3'\]"):
        runtime.load(profile="base")
    (tmp_path / "base.yaml").write_text("use_fa2: false\n")
    with pytest.raises(ValueError, match="must define every toggle"):
        runtime.load(profile="base")


# ---------------------------------------------------------------------------------------------
# Routing decisions
# ---------------------------------------------------------------------------------------------
def test_cpu_routes_everything_to_sdpa(env):
    env.setenv("NSA_PROFILE", "sm90")
    for branch in routing.BRANCHES:
        name, reason = routing.route(branch, seq_len=8192, requires_grad=False, device="cpu")
        assert name == "sdpa" and "cpu" in reason


def test_selection_routing_on_cuda(env):
    env.setenv("NSA_PROFILE", "sm90")  # Triton on, min_l 128
    route = lambda **kw: routing.route("selected_attention", device=CUDA, **kw)  # noqa: E731
    assert route(seq_len=4096, requires_grad=True) == \
        ("triton", "NSA_USE_TRITON_SEL=1 (profile:sm90), seq_len 4096 >= 128")
    assert route(seq_len=100, requires_grad=False) == \
        ("sdpa", "seq_len 100 < NSA_SEL_TRITON_MIN_L=128 (profile:sm90)")
    env.setenv("NSA_SEL_TRITON_ALLOW_GRAD", "0")
    assert route(seq_len=4096, requires_grad=True) == \
        ("sdpa", "gradients required and NSA_SEL_TRITON_ALLOW_GRAD=0 (env)")
    assert route(seq_len=4096, requires_grad=False)[0] == "triton"
    env.setenv("NSA_USE_TRITON_SEL", "0")
    assert route(seq_len=4096, requires_grad=False) == ("sdpa", "NSA_USE_TRITON_SEL=0 (env)")
    env.setenv("NSA_TRITON_SEL_FORCE", "1")  # force beats use, length and grad
    assert route(seq_len=1, requires_grad=True) == ("triton", "NSA_TRITON_SEL_FORCE=1 (env)")


def test_forced_triton_needs_a_device_or_the_interpreter(env):
    env.setenv("NSA_TRITON_SEL_FORCE", "1")
    name, reason = routing.route("selected_attention", seq_len=8, requires_grad=False,
                                 device="cpu")
    assert name == "sdpa" and reason.startswith("NSA_TRITON_SEL_FORCE=1 (env) but")
    env.setenv("TRITON_INTERPRET", "1")
    assert routing.route("selected_attention", seq_len=8, requires_grad=False,
                         device="cpu")[0] == "triton"
    env.setattr(routing.importlib.util, "find_spec", lambda name: None)
    assert routing.route("selected_attention", seq_len=8, requires_grad=False, device=CUDA) == \
        ("sdpa", "NSA_TRITON_SEL_FORCE=1 (env) but triton is not installed")


def test_fa2_routing_on_cuda(env):
    env.setenv("NSA_PROFILE", "sm90")  # FA-2 on; window >= 128, compressed >= 256
    route = lambda branch, n, **kw: routing.route(branch, seq_len=n, requires_grad=False,  # noqa
                                                  device=CUDA, **kw)
    assert route("sliding_window_attention", 128)[0] == "fa2"
    assert route("sliding_window_attention", 127)[0] == "sdpa"
    assert route("compressed_attention", 255) == \
        ("sdpa", "seq_len 255 < NSA_FA2_MIN_LEN_CMP=256 (profile:sm90)")
    assert route("compressed_attention", 256)[0] == "fa2"
    assert route("compressed_attention", 4096, dtype=torch.float32) == \
        ("sdpa", "dtype torch.float32: FlashAttention-2 takes float16/bfloat16")
    env.setenv("NSA_USE_FA2", "0")
    assert route("sliding_window_attention", 4096) == ("sdpa", "NSA_USE_FA2=0 (env)")
    env.setenv("NSA_FA2_FORCE_VARLEN", "1")  # forcing beats the use flag and the thresholds
    assert route("sliding_window_attention", 2) == ("fa2", "NSA_FA2_FORCE_VARLEN=1 (env)")
    assert route("compressed_attention", 2)[0] == "fa2"


def test_route_rejects_bad_arguments(env):
    with pytest.raises(ValueError, match="branch"):
        routing.route("cmp", seq_len=8, requires_grad=False, device="cpu")
    with pytest.raises(ValueError, match="seq_len"):
        routing.route("selected_attention", seq_len=-1, requires_grad=False, device="cpu")


def test_backends_for_follows_route(env):
    env.setenv("NSA_PROFILE", "sm90")
    assert routing.backends_for(seq_len=200, requires_grad=False, device=CUDA) == {
        "compressed_attention": "sdpa", "selected_attention": "triton",
        "sliding_window_attention": "fa2"}


# ---------------------------------------------------------------------------------------------
# Summary, logging, registration
# ---------------------------------------------------------------------------------------------
def test_main_prints_json(env, capsys):
    env.setenv("NSA_USE_TRITON_SEL", "0")
    assert routing.main(["--seq-len", "128", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["selected_attention"] == {"backend": "sdpa", "reason": "NSA_USE_TRITON_SEL=0 (env)"}
    assert set(routing.BRANCHES) <= set(result)
    assert result["profile"]["name"] == "base" and result["versions"]["torch"] == torch.__version__
    assert result["toggles"]["use_triton_sel"] == {"value": False, "env": "NSA_USE_TRITON_SEL",
                                                   "source": "env"}
    env.setenv("NSA_FA2_MIN_LEN_WIN", "abc")
    assert routing.main(["--device", "cpu"]) == 2
    assert "NSA_FA2_MIN_LEN_WIN" in json.loads(capsys.readouterr().out)["error"]


def test_module_entry_point(env):
    done = subprocess.run([sys.executable, "-m", "nsa_torch_ref.fast", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "NSA_USE_FA2": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["sliding_window_attention"]["backend"] == "sdpa"
    assert result["toggles"]["use_fa2"]["source"] == "env"


def test_debug_log_respects_limit_and_timing_logs(env, caplog):
    env.setenv("NSA_DEBUG_LOG", "1")
    env.setenv("NSA_LOG_LIMIT", "2")
    with caplog.at_level(logging.WARNING, logger="nsa_torch_ref"):
        for i in range(4):
            runtime.debug_log("kind", f"message {i}")
        assert [r.getMessage() for r in caplog.records] == ["[nsa kind] message 0",
                                                            "[nsa kind] message 1"]
        caplog.clear()
        env.setenv("NSA_DEBUG_LOG", "0")
        runtime.debug_log("other", "hidden")
        env.setenv("NSA_DEBUG_TIMING", "1")
        with runtime.timed("block"):
            pass
        assert len(caplog.records) == 1 and "[nsa timing] block:" in caplog.records[0].getMessage()


def test_auto_backend_routes_and_matches_sdpa(env, caplog):
    routing.register_fast_paths()
    for branch in routing.BRANCHES:
        assert {"auto", "sdpa"} <= set(dispatch.available(branch))
    assert "triton" in dispatch.available("selected_attention")
    assert "fa2" in dispatch.available("sliding_window_attention")
    from nsa_torch_ref import NSAAttention

    cfg = NSAConfig.tiny()
    torch.manual_seed(0)
    auto = NSAAttention(cfg, backends={b: "auto" for b in routing.BRANCHES})
    plain = NSAAttention(cfg)
    plain.load_state_dict(auto.state_dict())
    x = torch.randn(1, 20, cfg.d_model)
    env.setenv("NSA_DEBUG_LOG", "1")
    with caplog.at_level(logging.WARNING, logger="nsa_torch_ref"):
        y = auto(x)
    assert torch.equal(y, plain(x))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "selected_attention -> sdpa: NSA_USE_TRITON_SEL=0 (base)" in messages
