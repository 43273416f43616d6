"""Which backend each NSA branch takes, and why (docs/TORCH_RUNTIME.md).

`route(branch, seq_len=, requires_grad=, device=)` returns `(backend name, reason)` from the
runtime toggles (`runtime.load`: environment > profile > base). Backend names are the
`dispatch` names: "sdpa" (the reference), "triton" (selected attention), "fa2" (window and
compressed branches).

`register_fast_paths()` adds "triton", "fa2" and "auto" to `dispatch`. "auto" asks `route` on
every call and runs the chosen backend with the reference after it (`dispatch.call(branch,
(name, "sdpa"))`), so `NSAAttention(cfg, backends={b: "auto" for b in dispatch.BRANCHES})`
follows the toggles, and a call the chosen kernel refuses runs on the reference. The Triton
kernels are imported on first use, so registering needs neither Triton nor a GPU.

`python -m nsa_torch_ref.fast [--seq-len N] [--requires-grad] [--device D] [--dtype T]`
prints the decision for each branch as JSON, with the profile, the toggles and the versions.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Optional

import torch

from nsa_torch_ref import dispatch
from nsa_torch_ref.fast import fa2, runtime

REFERENCE = dispatch.DEFAULT_BACKEND
TRITON = "triton"
FA2 = "fa2"
AUTO = "auto"
BRANCHES = dispatch.BRANCHES


def _triton_usable(device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        return True, "CUDA device"
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return True, f"TRITON_INTERPRET=1 on {device.type}"
    return False, f"device {device.type}: the Triton kernel needs CUDA"


def _fa2_usable(device: torch.device, dtype: Optional[torch.dtype]) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"device {device.type}: FlashAttention-2 needs CUDA"
    if dtype is not None and dtype not in fa2.FLASH_DTYPES:
        return False, f"dtype {dtype}: FlashAttention-2 takes float16/bfloat16"
    return True, "CUDA device"


def route(branch: str, *, seq_len: int, requires_grad: bool, device,
          dtype: Optional[torch.dtype] = None,
          config: Optional[runtime.RuntimeConfig] = None) -> tuple[str, str]:
    """(backend name, reason) for one call of `branch` on a sequence of `seq_len` tokens."""
    if branch not in BRANCHES:
        raise ValueError(f"branch ({branch!r}) must be one of {list(BRANCHES)}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len ({seq_len!r}) must be a non-negative int")
    device = torch.device(device)
    config = config if config is not None else runtime.load(device)
    say = config.describe

    if branch == "selected_attention":
        usable, why = _triton_usable(device)
        if config.triton_sel_force:
            if usable:
                return TRITON, f"{say('triton_sel_force')}"
            return REFERENCE, f"{say('triton_sel_force')} but {why}"
        if not config.use_triton_sel:
            return REFERENCE, say("use_triton_sel")
        if not usable:
            return REFERENCE, why
        if requires_grad and not config.sel_triton_allow_grad:
            return REFERENCE, f"gradients required and {say('sel_triton_allow_grad')}"
        if seq_len < config.sel_triton_min_l:
            return REFERENCE, f"seq_len {seq_len} < {say('sel_triton_min_l')}"
        return TRITON, f"{say('use_triton_sel')}, seq_len {seq_len} >= {config.sel_triton_min_l}"

    threshold_key = "fa2_min_len_win" if branch == "sliding_window_attention" else "fa2_min_len_cmp"
    usable, why = _fa2_usable(device, dtype)
    forced = [key for key in ("fa2_force_varlen", "fa2_force_dense") if getattr(config, key)]
    if forced:
        if usable:
            return FA2, say(forced[0])
        return REFERENCE, f"{say(forced[0])} but {why}"
    if not config.use_fa2:
        return REFERENCE, say("use_fa2")
    if not usable:
        return REFERENCE, why
    threshold = getattr(config, threshold_key)
    if seq_len < threshold:
        return REFERENCE, f"seq_len {seq_len} < {say(threshold_key)}"
    return FA2, f"{say('use_fa2')}, seq_len {seq_len} >= {threshold}"


def backends_for(*, seq_len: int, requires_grad: bool, device,
                 dtype: Optional[torch.dtype] = None) -> dict[str, str]:
    """{branch: backend name}: a `backends` mapping for `NSAAttention` fixed for one shape."""
    config = runtime.load(torch.device(device))
    return {branch: route(branch, seq_len=seq_len, requires_grad=requires_grad, device=device,
                          dtype=dtype, config=config)[0] for branch in BRANCHES}


# ---------------------------------------------------------------------------------------------
# Registration with dispatch
# ---------------------------------------------------------------------------------------------
def _triton_selected_attention(q, k, v, block_idx, block_size, scale=None):
    """The Triton kernels, imported on the first call (`triton_selection` reads
    TRITON_INTERPRET when it is imported)."""
    try:
        from nsa_torch_ref.fast.triton_selection import selected_attention_triton
    except ImportError as error:
        raise dispatch.Unsupported(f"the Triton kernels cannot be imported ({error})") from None
    return selected_attention_triton(q, k, v, block_idx, block_size, scale)


def _requires_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _auto(branch: str):
    def call(q, k, v, *args, **kwargs):
        config = runtime.load(q.device)
        name, reason = route(branch, seq_len=q.shape[1], requires_grad=_requires_grad(q, k, v),
                             device=q.device, dtype=q.dtype, config=config)
        runtime.debug_log(f"route:{branch}", f"{branch} -> {name}: {reason}", config)

        def refused(backend: str, error: NotImplementedError) -> None:
            runtime.debug_log(f"refused:{branch}", f"{branch}: {backend} refused the call "
                              f"({error}); trying the next backend", config)

        with runtime.timed(f"{branch}[{name}]", config):
            return dispatch.call(branch, (name,) if name == REFERENCE else (name, REFERENCE),
                                 q, k, v, *args, on_refusal=refused, **kwargs)

    call.__name__ = f"auto_{branch}"
    return call


def register_fast_paths() -> None:
    """Register "triton" (selection), "fa2" (window, compressed) and "auto" (all three)."""
    dispatch.register("selected_attention", TRITON, _triton_selected_attention)
    dispatch.register("compressed_attention", FA2, fa2.compressed_attention_fa2)
    dispatch.register("sliding_window_attention", FA2, fa2.sliding_window_attention_fa2)
    for branch in BRANCHES:
        dispatch.register(branch, AUTO, _auto(branch))


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def versions() -> dict:
    found = {"python": sys.version.split()[0], "torch": torch.__version__,
             "cuda": torch.version.cuda, "triton": None}
    if importlib.util.find_spec("triton") is not None:
        try:
            import triton
            found["triton"] = triton.__version__
        except Exception as error:  # a broken install still gets a summary
            found["triton"] = f"import failed: {error}"
    found.update(fa2.versions())
    capability = runtime.cuda_capability()
    found["device"] = (f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})"
                       if capability else "cpu")
    return found


def summary(*, seq_len: int = 4096, requires_grad: bool = False, device=None,
            dtype: Optional[torch.dtype] = torch.bfloat16) -> dict:
    """The routing decision of every branch, with the profile, toggles and versions."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    profile, profile_reason = runtime.detect_profile(device)
    config = runtime.load(device, profile=profile)
    result: dict = {}
    for branch in BRANCHES:
        name, reason = route(branch, seq_len=seq_len, requires_grad=requires_grad,
                             device=device, dtype=dtype, config=config)
        result[branch] = {"backend": name, "reason": reason}
    result["profile"] = {"name": profile, "reason": profile_reason}
    result["inputs"] = {"seq_len": seq_len, "requires_grad": requires_grad,
                        "device": str(device), "dtype": str(dtype)}
    result["toggles"] = config.as_dict()
    result["versions"] = versions()
    return result


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_torch_ref.fast",
                                     description="Print the backend each NSA branch takes.")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--requires-grad", action="store_true")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    try:
        result = summary(seq_len=args.seq_len, requires_grad=args.requires_grad,
                         device=args.device, dtype=_DTYPES[args.dtype])
    except ValueError as error:
        print(json.dumps({"error": str(error)}, indent=2))
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0

