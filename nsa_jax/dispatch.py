"""The one dispatch point between the layer / kernel-level API and the implementations.

A registry maps `(branch, backend)` to a function. Plugging in a backend is one call, e.g.

    register_backend("selected_attention", "pallas", pallas_kernels.selected_attention)

Calling conventions, per branch (arrays BTHD; `scale` is already resolved to a float):

    compress_kv(k, cmp_params, cfg)
    compressed_attention(q, k_cmp, v_cmp, cfg, *, scale, return_lse)
    select_blocks(q, k_cmp, cfg, *, scale[, lse])  (lse [B, T, H] when the caller has it)
    selected_attention(q, k, v, block_idx, *, block_size, scale)
    sliding_window_attention(q, k, v, *, window, scale)
    selected_block_mass(q, k, block_idx, *, block_size, scale, q_chunk, kv_blocks)
        -> the log attention mass of each selected slot `[B, T, G, n_sel]`, no gradient (the
        selection-alignment loss's target, `nsa_jax.alignment`; q_chunk / kv_blocks size the
        XLA path's chunks)
    selected_importance(q, k_cmp, lse, blocks, cfg, *, scale, q_chunk)
        -> the log group importance (spec step 6) of each block of `blocks [B, T, G, K]`,
        differentiable in q, k_cmp and lse (the compressed attention's `[B, T, H]`); the
        alignment loss's ranking in sparse mode

and the decode entries, for queries q `[B, Q, H, d_k]` at positions `[B, Q]` attending a decode
cache (Q is 1 in a decode step; a chunked prefill passes its whole chunk):

    decode_append(buffers, tokens, index, cfg, *, positions) -> buffers: each buffer
        `[B, S, G, d]` with `tokens[i] [B, Q, G, d]` written at rows `index[i] [B, Q]`
        (`>= S`: not written); the step's six appends in one entry
    decode_compressed_attention(q, k_cmp, v_cmp, cfg, *, positions, scale)
        -> (o_cmp [B, Q, H, d_v], p_group [B, Q, G, C]: probabilities summed over each group)
    decode_select_blocks(p_group, cfg, *, positions, n_sel_blocks) -> block_idx [B, Q, G, n_sel]
    decode_compressed_select(q, k_cmp, v_cmp, cfg, *, positions, scale, n_sel_blocks)
        -> (o_cmp, block_idx): the two above in one entry, which a backend may fuse
    decode_selected_window_attention(q, k_sel, v_sel, block_idx, k_win, v_win, cfg, *,
                                     positions, scale, window_tokens) -> (o_sel, o_win)
        (window_tokens None: k_win / v_win are the cache's ring, token s in slot s % W;
        otherwise int `[B, K]`, the token held by each of their K rows)
    decode_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, cfg, *, positions, scale,
                     n_sel_blocks, block_idx, gate, q_rows)
        -> (o_cmp, o_sel, o_win, block_idx, o): the two above on the cache's ring in one
        entry, which a backend may fuse (block_idx None: the entry selects; given: the selected
        branch reads those blocks). gate: `(the step's projections [B, W], the column of head
        0's first gate logit, bg [3H])` or None; o: the branches mixed by those gates (spec step
        9), or None where the entry leaves the mix to the caller; q_rows `[B, W]` or None: the
        step's RoPE'd heads, whose first H*d_k columns are q's values (an entry may read q
        there instead of q's own copy)
    decode_compress(rings, buffers, cmp_params, cfg, *, positions, limit) -> buffers: where the
        token at `positions[b]` (< limit) completes a compressed block, its summary from the raw
        rings (`(k_raw, v_raw)`) written into `buffers` (`(k_cmp, v_cmp)`); cmp_params
        `(cmp_k, cmp_v)` or None (mean). No XLA entry: without one the step compresses in XLA
        under a `cond`, through `compress_kv`

plus, when the caller has them, `segments=` (packed sequences, `nsa_jax.segments.Segments`;
only passed to backends registered with `packed=True`) and `options=` (that backend's entry of
the caller's `options` mapping). An implementation that cannot handle its input raises
`NotImplementedError`. `backend` is one name, or a sequence of names tried in order: a
sequence falls through (e.g. `("my-kernels", "xla")`). A backend that implements only some
branches may name a fallback when it registers (`register_fallback`): `"pallas"` is
`("pallas", "xla")`, i.e. "the Pallas kernels where they exist, XLA for the rest". Other single
names never silently change path.
When no backend is left, `NoBackendError` (both a NotImplementedError and a ValueError) says why
each one refused.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax

from nsa_jax import nonfinite, xla

BRANCHES = ("compress_kv", "compressed_attention", "select_blocks", "selected_attention",
            "sliding_window_attention", "selected_block_mass", "selected_importance")
DECODE_BRANCHES = ("decode_append", "decode_compressed_attention", "decode_select_blocks",
                   "decode_compressed_select", "decode_selected_window_attention",
                   "decode_attention", "decode_compress")

Backend = Union[str, Sequence[str]]


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: Callable
    packed: bool


_REGISTRY: dict[tuple[str, str], _Entry] = {}
# backend name -> the names tried after it when it is asked for (see `register_fallback`).
_FALLBACKS: dict[str, tuple[str, ...]] = {}
# Bumped by every registration and part of every static `jit` key below, so that a compiled
# call never keeps running an implementation that has since been replaced.
_generation = 0


def register_backend(branch: str, backend: str, fn: Callable, *, packed: bool = False) -> None:
    """Make `fn` the `backend` implementation of `branch` (replacing any previous one).

    packed: whether `fn` accepts `segments=` (packed sequences); if not, packed inputs are
    handed to the next backend of the caller's list.
    Where n_sel covers every selection block of the sequence and the selection and selected
    branch are the library's own (`library_only`), the layer runs its selected branch as
    `sliding_window_attention` with w = T, the same causal attention, and takes every eligible
    block as `block_idx` without running the selection; a backend registered here for
    `select_blocks` or `selected_attention` turns that off, so it always runs.
    """
    if branch not in BRANCHES + DECODE_BRANCHES:
        raise ValueError(f"branch ({branch!r}) must be one of {BRANCHES + DECODE_BRANCHES}")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend ({backend!r}) must be a non-empty str")
    global _generation
    _REGISTRY[(branch, backend)] = _Entry(fn, packed)
    _generation += 1


def library_only(branch: str, backend: Backend) -> bool:
    """Whether every implementation of `branch` that `backend` may run is the library's own
    (none registered from outside `nsa_jax` / `pallas_kernels`): then the layer may replace the
    branch by an equivalent computation without skipping a caller's code."""
    modules = [getattr(_REGISTRY[(branch, name)].fn, "__module__", None) or ""
               for name in backend_names(backend) if (branch, name) in _REGISTRY]
    return bool(modules) and all(m.split(".")[0] in ("nsa_jax", "pallas_kernels")
                                 for m in modules)


def register_fallback(backend: str, fallback: Sequence[str]) -> None:
    """Make `backend` mean `(backend, *fallback)` wherever it is named, so that a backend with
    kernels for some branches only is complete on its own (`"pallas"` -> `("pallas", "xla")`)."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend ({backend!r}) must be a non-empty str")
    fallback = (fallback,) if isinstance(fallback, str) else tuple(fallback)
    if not all(isinstance(n, str) and n and n != backend for n in fallback):
        raise ValueError(f"fallback ({fallback!r}) must be names other than {backend!r}")
    global _generation
    _FALLBACKS[backend] = fallback
    _generation += 1


def known_backends() -> tuple[str, ...]:
    """Every backend name with at least one registered branch."""
    return tuple(sorted({name for _, name in _REGISTRY}))


def backend_names(backend: Backend) -> tuple[str, ...]:
    """Validate `backend` (a name or a sequence of names) and return it as a tuple, each name
    followed by its registered fallbacks (`register_fallback`), without repeats."""
    if isinstance(backend, StaticBackend):
        return tuple(backend[:-1])
    names = (backend,) if isinstance(backend, str) else tuple(backend)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"backend ({backend!r}) must be a name or a non-empty sequence of names")
    unknown = [n for n in names if n not in known_backends()]
    if unknown:
        raise ValueError(f"backend {unknown[0]!r} is unknown; known backends: "
                         f"{list(known_backends())}")
    expanded: list[str] = []
    for name in names:
        expanded += [n for n in (name, *_FALLBACKS.get(name, ())) if n not in expanded]
    return tuple(expanded)


def call(branch: str, backend: Backend, *args, segments=None,
         options: Optional[Mapping[str, Any]] = None, **kwargs):
    """Run `branch` on the first backend of `backend` that can handle the input.

    Every backend runs inside `nonfinite.GUARDS[branch]`: it sees only finite inputs, and the
    outputs that attend a non-finite value become NaN (isolation of NaN / inf between tokens
    and sequences, whatever the backend does with masked keys). The decode entries are not
    guarded (docs/ROBUSTNESS.md)."""
    run = functools.partial(_first_capable, branch, backend, options=options)
    return nonfinite.GUARDS[branch](run, *args, segments=segments, **kwargs)


def _first_capable(branch: str, backend: Backend, *args, segments=None,
                   options: Optional[Mapping[str, Any]] = None, **kwargs):
    reasons = []
    names = backend_names(backend)
    for name in names:
        entry = _REGISTRY.get((branch, name))
        if entry is None:
            reasons.append(f"{name!r} has no {branch}")
            continue
        if segments is not None and not entry.packed:
            reasons.append(f"{name!r} {branch} does not take packed sequences")
            continue
        extra = dict(kwargs)
        if segments is not None:
            extra["segments"] = segments
        if options and name in options:
            extra["options"] = options[name]
        try:
            return entry.fn(*args, **extra)
        except NotImplementedError as err:
            reasons.append(f"{name!r}: {err}")
    raise NoBackendError(f"no backend of {list(names)} can run {branch}: " + "; ".join(reasons))


class NoBackendError(NotImplementedError, ValueError):
    """No backend of the caller's choice takes the input (its reasons in the message, e.g. the
    dtypes a kernel takes). Also a ValueError: for the caller it is a bad argument (the backend,
    or the input given to a lone backend), as is any other input that the layer refuses."""


for _branch in BRANCHES:
    register_backend(_branch, "xla", getattr(xla, _branch), packed=True)
for _branch in DECODE_BRANCHES:
    if hasattr(xla, _branch):   # decode_compress: XLA's is the step's own cond (nsa_jax.decode)
        register_backend(_branch, "xla", getattr(xla, _branch))


def static_options(options: Optional[Mapping[str, Any]]) -> Optional[tuple]:
    """`options` as a hashable tuple of items, so it can be a static argument of `jax.jit`."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f"options must be a mapping of backend name -> options, got "
                         f"{type(options).__name__}")
    items = tuple(sorted(options.items()))
    try:
        hash(items)
    except TypeError:
        raise ValueError("options values must be hashable (frozen dataclasses such as "
                         "XlaOptions)") from None
    return items


class StaticBackend(tuple):
    """A validated backend choice, hashable (a `jax.jit` static argument) and stamped with the
    registry generation. Pass it wherever a `Backend` goes."""


def static_backend(backend: Backend) -> StaticBackend:
    """`backend` validated, as `(names..., generation)`."""
    if isinstance(backend, StaticBackend):
        return backend
    return StaticBackend((*backend_names(backend), _generation))


@functools.partial(jax.jit, static_argnames=("branch", "backend", "options", "static_args",
                                             "static_kwargs"))
def jit_call(arrays: tuple, array_kwargs: dict, *, branch: str, backend, options,
             static_args: tuple = (), static_kwargs: tuple = ()):
    """`call` compiled once per static configuration (eager callers would otherwise pay for
    op-by-op dispatch). arrays / array_kwargs: the traced (pytree) arguments; static_args follow
    the arrays positionally; options / static_kwargs are tuples of items."""
    return call(branch, backend, *arrays, *static_args,
                options=dict(options) if options else None, **array_kwargs,
                **dict(static_kwargs))
