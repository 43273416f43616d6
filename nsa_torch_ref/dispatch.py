"""The one dispatch point between the NSA layer and the attention kernels of its three branches.

Same shape as `nsa_jax.dispatch`: a registry maps `(branch, backend name)` to a function, and a
caller chooses, per branch, one name or an ordered sequence of names. `call` runs the first
backend of the choice that serves the input. A backend that cannot (a dtype, a device, a head
dim its kernels lack) raises `NotImplementedError` with the reason (usually `Unsupported`) and the
next one runs; when none is left, `NoBackendError` lists every reason. A single name never
silently changes path: `("triton", "sdpa")` falls back to the reference, `"triton"` does not.

A backend has the kernel-level signature of its branch (docs/DESIGN.md):

- "compressed_attention":     fn(q, k_cmp, v_cmp, cfg, *, scale=None) -> [B, T, H, d_v]
- "selected_attention":       fn(q, k, v, block_idx, block_size, scale=None) -> [B, T, H, d_v]
- "sliding_window_attention": fn(q, k, v, window, scale=None) -> [B, T, H, d_v]

"sdpa", the reference path of `reference.py`, is registered for every branch here and is the
default; `nsa_torch_ref.fast` registers "triton", "fa2" and "auto" (docs/TORCH_RUNTIME.md).
The layer's two steps around the branches, `compress_kv` (fn(k, cmp_params, cfg) -> [B, C, G, d])
and `select_blocks` (fn(q, k_cmp, cfg) -> block_idx int32 [B, T, G, n_sel]), are entries of the
same table (`STAGES`), so the layer reaches every piece of work through here; "sdpa" (the
reference) is their one backend today.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Optional, Sequence, Union

from nsa_torch_ref import reference

BRANCHES = ("compressed_attention", "selected_attention", "sliding_window_attention")
STAGES = ("compress_kv", "select_blocks")
ENTRIES = BRANCHES + STAGES
DEFAULT_BACKEND = "sdpa"

Backend = Union[str, Sequence[str]]  # one name, or names tried in order

_TABLE: dict[str, dict[str, Callable]] = {entry: {} for entry in ENTRIES}


class Unsupported(NotImplementedError, ValueError):
    """Raised by a backend for an input it cannot serve (the reason in the message): `call`
    moves on to the next backend. Also a ValueError: called on its own, the backend was given an
    argument it does not take (e.g. float64 for a kernel of fp16/bf16/fp32)."""


class NoBackendError(NotImplementedError, ValueError):
    """No backend of the caller's choice serves the input; the message has each one's reason."""


def _check_branch(branch: str) -> None:
    if branch not in _TABLE:
        raise ValueError(f"branch ({branch!r}) must be one of {list(ENTRIES)}")


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
    """The function of backend `name` for `branch` (no fallback); ValueError listing the known
    ones if absent."""
    _check_branch(branch)
    if name not in _TABLE[branch]:
        raise ValueError(f"unknown backend {name!r} for {branch!r}; known backends: "
                         f"{list(available(branch))}")
    return _TABLE[branch][name]


def backend_names(branch: str, backend: Backend) -> tuple[str, ...]:
    """`backend` (a name or a sequence of names) as a tuple, each name registered for `branch`."""
    names = (backend,) if isinstance(backend, str) else tuple(backend)
    if not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"backend ({backend!r}) of {branch!r} must be a name or a non-empty "
                         "sequence of names")
    for name in names:
        resolve(branch, name)
    return names


def call(branch: str, backend: Backend, *args,
         on_refusal: Optional[Callable[[str, NotImplementedError], None]] = None, **kwargs):
    """Run `branch` on the first backend of `backend` that serves the input.

    on_refusal(name, error), when given, hears of each backend that refused (e.g. to log it).
    """
    names = backend_names(branch, backend)
    reasons = []
    for name in names:
        try:
            return _TABLE[branch][name](*args, **kwargs)
        except NotImplementedError as error:
            reasons.append(f"{name!r}: {error}")
            if on_refusal is not None:
                on_refusal(name, error)
    raise NoBackendError(f"no backend of {list(names)} can run {branch}: " + "; ".join(reasons))


def resolve_all(backends: Optional[Mapping[str, Backend]] = None) -> dict[str, Callable]:
    """{entry: function running `call` on that entry's choice} for a `{entry: backend}`
    mapping over the branches and stages (`ENTRIES`); a missing entry uses "sdpa"."""
    backends = dict(backends or {})
    unknown = sorted(set(backends) - set(ENTRIES))
    if unknown:
        raise ValueError(f"backends has unknown branches {unknown}; branches are {list(ENTRIES)}")
    return {entry: partial(call, entry, backend_names(entry, backends.get(entry,
                                                                          DEFAULT_BACKEND)))
            for entry in ENTRIES}


register("compressed_attention", DEFAULT_BACKEND, reference.compressed_attention)
register("selected_attention", DEFAULT_BACKEND, reference.selected_attention)
register("sliding_window_attention", DEFAULT_BACKEND, reference.sliding_window_attention)
register("compress_kv", DEFAULT_BACKEND, reference.compress_kv)
register("select_blocks", DEFAULT_BACKEND, reference.select_blocks)
