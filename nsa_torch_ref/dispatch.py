"""The one dispatch point between the NSA layer and the attention kernels of its three branches.

A backend is a function with the kernel-level signature of its branch (docs/DESIGN.md):

- "compressed_attention":     fn(q, k_cmp, v_cmp, cfg, *, scale=None) -> [B, T, H, d_v]
- "selected_attention":       fn(q, k, v, block_idx, block_size, scale=None) -> [B, T, H, d_v]
- "sliding_window_attention": fn(q, k, v, window, scale=None) -> [B, T, H, d_v]

"sdpa" (the reference path in `reference.py`) is registered for every branch here; other modules
(Triton, FA-2) add theirs with `register` when they are imported. `NSAAttention` asks `resolve`
for its functions and never imports a kernel directly.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from nsa_torch_ref import reference

BRANCHES = ("compressed_attention", "selected_attention", "sliding_window_attention")
DEFAULT_BACKEND = "sdpa"

_TABLE: dict[str, dict[str, Callable]] = {branch: {} for branch in BRANCHES}


def _check_branch(branch: str) -> None:
    if branch not in _TABLE:
        raise ValueError(f"branch ({branch!r}) must be one of {list(BRANCHES)}")


def register(branch: str, name: str, fn: Callable) -> None:
    """Make `fn` the backend `name` of `branch` (replacing an earlier registration)."""
    _check_branch(branch)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name ({name!r}) must be a non-empty string")
    if not callable(fn):
        raise ValueError(f"fn for backend {name!r} of {branch!r} must be callable")
    _TABLE[branch][name] = fn


def available(branch: str) -> tuple[str, ...]:
    """Names of the backends registered for `branch`, sorted."""
    _check_branch(branch)
    return tuple(sorted(_TABLE[branch]))


def resolve(branch: str, name: str) -> Callable:
    """The function of backend `name` for `branch`; ValueError listing the known ones if absent."""
    _check_branch(branch)
    if name not in _TABLE[branch]:
        raise ValueError(f"unknown backend {name!r} for {branch!r}; known backends: "
                         f"{list(available(branch))}")
    return _TABLE[branch][name]


def resolve_all(backends: Optional[Mapping[str, str]] = None) -> dict[str, Callable]:
    """{branch: function} for a `{branch: backend name}` mapping; missing branches use "sdpa"."""
    backends = dict(backends or {})
    unknown = sorted(set(backends) - set(BRANCHES))
    if unknown:
        raise ValueError(f"backends has unknown branches {unknown}; branches are {list(BRANCHES)}")
    return {branch: resolve(branch, backends.get(branch, DEFAULT_BACKEND)) for branch in BRANCHES}


register("compressed_attention", DEFAULT_BACKEND, reference.compressed_attention)
register("selected_attention", DEFAULT_BACKEND, reference.selected_attention)
register("sliding_window_attention", DEFAULT_BACKEND, reference.sliding_window_attention)
