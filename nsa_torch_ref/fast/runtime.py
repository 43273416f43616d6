"""Runtime toggles of the PyTorch fast paths: one table, one loader, one precedence rule.

Each toggle has a key in `configs/base.yaml` (the defaults), may be overridden by a device
profile (`configs/profiles/<name>.yaml`) and then by an environment variable:

    environment  >  profile  >  base

The profile is `NSA_PROFILE` when set, else the CUDA capability of the current device
(sm_89 -> "sm89", sm_90 -> "sm90"; a capability without a profile file, or no CUDA, -> "base").
A malformed value raises ValueError naming its source (`NSA_FA2_MIN_LEN_WIN ('abc') must be an
int`). The environment is read on every `load()` call, so a test can monkeypatch it; the YAML
files are parsed once.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PROFILE_DIR = CONFIG_DIR / "profiles"
BASE_PROFILE = "base"
LOGGER = logging.getLogger("nsa_torch_ref")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Toggle:
    """One runtime setting: its YAML key, its environment variable and its type."""

    key: str
    env: str
    kind: type  # bool or int
    help: str


TOGGLES: tuple[Toggle, ...] = (
    Toggle("use_triton_sel", "NSA_USE_TRITON_SEL", bool,
           "use the Triton selected-attention kernel when the other conditions hold"),
    Toggle("triton_sel_force", "NSA_TRITON_SEL_FORCE", bool,
           "use Triton for selection whatever use_triton_sel, the length and grad say"),
    Toggle("sel_triton_allow_grad", "NSA_SEL_TRITON_ALLOW_GRAD", bool,
           "allow the Triton selection path when gradients are required"),
    Toggle("sel_triton_min_l", "NSA_SEL_TRITON_MIN_L", int,
           "shortest sequence (tokens) routed to Triton selection"),
    Toggle("use_fa2", "NSA_USE_FA2", bool,
           "use FlashAttention-2 kernels for the window and compressed branches"),
    Toggle("fa2_min_len_win", "NSA_FA2_MIN_LEN_WIN", int,
           "shortest sequence (tokens) routed to FA-2 for the sliding window"),
    Toggle("fa2_min_len_cmp", "NSA_FA2_MIN_LEN_CMP", int,
           "shortest sequence (tokens) routed to FA-2 for the compressed branch"),
    Toggle("fa2_force_varlen", "NSA_FA2_FORCE_VARLEN", bool,
           "force FA-2 (both branches) through the varlen (cu_seqlens) API"),
    Toggle("fa2_force_dense", "NSA_FA2_FORCE_DENSE", bool,
           "force FA-2 (both branches) through the dense API, one call per packed sequence"),
    Toggle("debug_log", "NSA_DEBUG_LOG", bool, "log routing decisions (logger nsa_torch_ref)"),
    Toggle("log_limit", "NSA_LOG_LIMIT", int, "at most this many log lines per message kind"),
    Toggle("debug_timing", "NSA_DEBUG_TIMING", bool, "log the wall time of each branch call"),
)
TOGGLE_BY_KEY = {toggle.key: toggle for toggle in TOGGLES}


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Resolved toggles. `sources[key]` says where each value came from: "env", "profile:<name>"
    or "base"."""

    profile: str
    use_triton_sel: bool
    triton_sel_force: bool
    sel_triton_allow_grad: bool
    sel_triton_min_l: int
    use_fa2: bool
    fa2_min_len_win: int
    fa2_min_len_cmp: int
    fa2_force_varlen: bool
    fa2_force_dense: bool
    debug_log: bool
    log_limit: int
    debug_timing: bool
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def describe(self, key: str) -> str:
        """`NSA_USE_FA2=0 (env)`: a toggle's value and where it came from, for reasons/logs."""
        toggle = TOGGLE_BY_KEY[key]
        value = getattr(self, key)
        shown = int(value) if toggle.kind is bool else value
        return f"{toggle.env}={shown} ({self.sources.get(key, 'base')})"

    def as_dict(self) -> dict:
        return {t.key: {"value": getattr(self, t.key), "env": t.env,
                        "source": self.sources.get(t.key, "base")} for t in TOGGLES}


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def parse_value(toggle: Toggle, raw: Any, source: str) -> Any:
    """Convert a YAML or environment value; ValueError naming `source` when it is malformed."""
    if toggle.kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{source} ({raw!r}) must be a boolean: one of "
                         f"{'/'.join(_TRUE + _FALSE)}")
    if isinstance(raw, bool):
        raise ValueError(f"{source} ({raw!r}) must be an int, not a boolean")
    try:
        value = int(str(raw).strip()) if not isinstance(raw, int) else raw
    except ValueError:
        raise ValueError(f"{source} ({raw!r}) must be an int") from None
    if value < 0:
        raise ValueError(f"{source} ({value}) must be >= 0")
    return value


@functools.lru_cache(maxsize=None)
def _read_yaml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {file} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {file} must hold a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOGGLE_BY_KEY))
    if unknown:
        raise ValueError(f"config file {file} has unknown keys {unknown}; known: "
                         f"{sorted(TOGGLE_BY_KEY)}")
    return {key: parse_value(TOGGLE_BY_KEY[key], value, f"{file.name}:{key}")
            for key, value in data.items()}


def available_profiles() -> list[str]:
    return [BASE_PROFILE] + sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def cuda_capability(device=None) -> Optional[tuple[int, int]]:
    """(major, minor) of `device` (default: the current CUDA device), None without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def detect_profile(device=None) -> tuple[str, str]:
    """(profile name, why): NSA_PROFILE, else the CUDA capability, else "base"."""
    chosen = os.environ.get("NSA_PROFILE", "").strip()
    if chosen:
        if chosen not in available_profiles():
            raise ValueError(f"NSA_PROFILE ({chosen!r}) must be one of {available_profiles()}")
        return chosen, f"NSA_PROFILE={chosen} (env)"
    capability = cuda_capability(device)
    if capability is None:
        return BASE_PROFILE, "no CUDA device"
    name = f"sm{capability[0]}{capability[1]}"
    if (PROFILE_DIR / f"{name}.yaml").is_file():
        return name, f"CUDA capability sm_{capability[0]}{capability[1]}"
    return BASE_PROFILE, f"CUDA capability sm_{capability[0]}{capability[1]} has no profile"


def load(device=None, profile: Optional[str] = None) -> RuntimeConfig:
    """Resolve every toggle: environment > profile > base (see the module docstring)."""
    if profile is None:
        profile, _ = detect_profile(device)
    elif profile not in available_profiles():
        raise ValueError(f"profile ({profile!r}) must be one of {available_profiles()}")
    values = dict(_read_yaml(str(CONFIG_DIR / "base.yaml")))
    missing = sorted(set(TOGGLE_BY_KEY) - set(values))
    if missing:
        raise ValueError(f"configs/base.yaml must define every toggle; missing {missing}")
    sources = {key: "base" for key in values}
    if profile != BASE_PROFILE:
        for key, value in _read_yaml(str(PROFILE_DIR / f"{profile}.yaml")).items():
            values[key] = value
            sources[key] = f"profile:{profile}"
    for toggle in TOGGLES:
        raw = os.environ.get(toggle.env)
        if raw is not None and raw.strip() != "":
            values[toggle.key] = parse_value(toggle, raw, toggle.env)
            sources[toggle.key] = "env"
    if values["fa2_force_varlen"] and values["fa2_force_dense"]:
        raise ValueError(f"NSA_FA2_FORCE_VARLEN ({sources['fa2_force_varlen']}) and "
                         f"NSA_FA2_FORCE_DENSE ({sources['fa2_force_dense']}) cannot both be on")
    return RuntimeConfig(profile=profile, sources=sources, **values)


# ---------------------------------------------------------------------------------------------
# Debug logging and timing
# ---------------------------------------------------------------------------------------------
_LOG_COUNTS: dict[str, int] = {}


def debug_log(kind: str, message: str, config: Optional[RuntimeConfig] = None) -> None:
    """Log `message` when NSA_DEBUG_LOG is on, at most NSA_LOG_LIMIT times per `kind`."""
    config = config or load()
    if not config.debug_log:
        return
    count = _LOG_COUNTS.get(kind, 0)
    if count >= config.log_limit:
        return
    _LOG_COUNTS[kind] = count + 1
    LOGGER.warning("[nsa %s] %s", kind, message)


def reset_log_counts() -> None:
    _LOG_COUNTS.clear()


@contextmanager
def timed(name: str, config: Optional[RuntimeConfig] = None):
    """Log the wall time of the block when NSA_DEBUG_TIMING is on (synchronising CUDA first, so
    the time is the kernel's, not the launch's)."""
    config = config or load()
    if not config.debug_timing:
        yield
        return
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        sync()
        elapsed = (time.perf_counter() - start) * 1e3
        count = _LOG_COUNTS.get(f"timing:{name}", 0)
        if count < config.log_limit:
            _LOG_COUNTS[f"timing:{name}"] = count + 1
            LOGGER.warning("[nsa timing] %s: %.3f ms", name, elapsed)
