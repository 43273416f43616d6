"""Kernel-level NSA functions on BTHD arrays, one per branch (DESIGN.md signatures).

Each validates its inputs, resolves `scale`, and hands off to `nsa_jax.dispatch`. `backend` is
a registered name (`"xla"` here) or a sequence of names tried in order; `options` maps a backend
name to that backend's options (e.g. `{"xla": XlaOptions(selected_q_chunk=32)}`).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import chex
import jax
import jax.numpy as jnp

from nsa_common import NSAConfig, num_cmp_blocks
from nsa_jax import checks, dispatch

Options = Optional[Mapping[str, Any]]


def _run(branch: str, backend, options: Options, arrays: tuple, static_args: tuple = (),
         array_kwargs: Optional[dict] = None, **static_kwargs):
    """Dispatch `branch` through one compiled call (static: everything but the arrays)."""
    return dispatch.jit_call(arrays, array_kwargs or {}, branch=branch,
                             backend=dispatch.static_backend(backend),
                             options=dispatch.static_options(options), static_args=static_args,
                             static_kwargs=tuple(sorted(static_kwargs.items())))


def compress_kv(k: jax.Array, cmp_params: Optional[Mapping[str, jax.Array]], cfg: NSAConfig, *,
                backend: dispatch.Backend = "xla", options: Options = None) -> jax.Array:
    """k `[B, T, G, dim]` -> compressed `[B, C, G, dim]`, `C = num_cmp_blocks(cfg, T)`.

    cmp_params: the `cmp_k` / `cmp_v` dict (`compress="mlp"`), or None (`compress="mean"`).
    """
    checks.config(cfg)
    checks.array("k", k, 4)
    checks.cmp_params("cmp_params", cmp_params, cfg, k.shape[2], k.shape[3])
    out = _run("compress_kv", backend, options, (k, cmp_params), (cfg,))
    B, T, G, D = k.shape
    chex.assert_shape(out, (B, num_cmp_blocks(cfg, T), G, D))
    return out


def _check_cmp_inputs(q, k_cmp, cfg, v_cmp=None):
    checks.config(cfg)
    checks.array("k_cmp", k_cmp, 4)
    checks.queries("q", q, n_kv_heads=k_cmp.shape[2])
    checks.dim("k_cmp", k_cmp.shape[0], q.shape[0], "batch size")
    checks.dim("k_cmp", k_cmp.shape[3], q.shape[3], "head dim")
    checks.dim("k_cmp", k_cmp.shape[1], num_cmp_blocks(cfg, q.shape[1]),
               "compressed blocks (axis 1)")
    if v_cmp is not None:
        checks.array("v_cmp", v_cmp, 4)
        checks.dim("v_cmp", v_cmp.shape[:3], k_cmp.shape[:3], "[B, C, G]")


def compressed_attention(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array, cfg: NSAConfig, *,
                         scale: Optional[float] = None, return_lse: bool = False,
                         backend: dispatch.Backend = "xla", options: Options = None):
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]`, v_cmp `[B, C, G, d_v]` -> o_cmp
    `[B, T, H, d_v]` (q's dtype), and with `return_lse` also lse `[B, T, H]` (float32, or
    float64 for float64 inputs; -inf where no compressed block is admissible)."""
    _check_cmp_inputs(q, k_cmp, cfg, v_cmp)
    out = _run("compressed_attention", backend, options, (q, k_cmp, v_cmp), (cfg,),
               scale=checks.scale(scale, q.shape[-1]), return_lse=bool(return_lse))
    B, T, H, _ = q.shape
    o = out[0] if return_lse else out
    chex.assert_shape(o, (B, T, H, v_cmp.shape[-1]))
    chex.assert_type(o, q.dtype)
    if return_lse:
        chex.assert_shape(out[1], (B, T, H))
    return out


def select_blocks(q: jax.Array, k_cmp: jax.Array, cfg: NSAConfig, *,
                  scale: Optional[float] = None, lse: Optional[jax.Array] = None,
                  backend: dispatch.Backend = "xla", options: Options = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]` -> block_idx int32 `[B, T, G, n_sel]`:
    ascending, -1 padded; no gradient flows through it.

    lse: optionally the `[B, T, H]` log-sum-exp that `compressed_attention(..., return_lse=True)`
    gave for the same inputs; backends that normalise with it (Pallas) then skip recomputing it.
    """
    _check_cmp_inputs(q, k_cmp, cfg)
    extra = {}
    if lse is not None:
        checks.array("lse", lse, 3)
        checks.dim("lse", tuple(lse.shape), tuple(q.shape[:3]), "shape")
        extra["lse"] = lse
    block_idx = _run("select_blocks", backend, options, (q, k_cmp), (cfg,), array_kwargs=extra,
                     scale=checks.scale(scale, q.shape[-1]))
    chex.assert_shape(block_idx, (*q.shape[:2], k_cmp.shape[2], cfg.n_sel))
    chex.assert_type(block_idx, jnp.int32)
    return block_idx


def _check_kv(q, k, v):
    checks.array("k", k, 4)
    checks.array("v", v, 4)
    checks.queries("q", q, n_kv_heads=k.shape[2])
    checks.dim("k", k.shape[:2], q.shape[:2], "[B, T]")
    checks.dim("k", k.shape[3], q.shape[3], "head dim")
    checks.dim("v", v.shape[:3], k.shape[:3], "[B, T, G]")


def selected_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array,
                       block_size: int, scale: Optional[float] = None, *,
                       backend: dispatch.Backend = "xla", options: Options = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k `[B, T, G, d_k]`, v `[B, T, G, d_v]`, block_idx int `[B, T, G, n]`
    -> `[B, T, H, d_v]`: query t attends the tokens `<= t` of its group's blocks (-1 = none)."""
    _check_kv(q, k, v)
    checks.array("block_idx", block_idx, 4, floating=False, integer=True)
    checks.dim("block_idx", block_idx.shape[:3], k.shape[:3], "[B, T, G]")
    checks.positive_int("block_size", block_size)
    out = _run("selected_attention", backend, options, (q, k, v, block_idx.astype(jnp.int32)),
               block_size=block_size, scale=checks.scale(scale, q.shape[-1]))
    chex.assert_shape(out, (*q.shape[:3], v.shape[-1]))
    chex.assert_type(out, q.dtype)
    return out


def sliding_window_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int,
                             scale: Optional[float] = None, *,
                             backend: dispatch.Backend = "xla",
                             options: Options = None) -> jax.Array:
    """q `[B, T, H, d_k]`, k `[B, T, G, d_k]`, v `[B, T, G, d_v]` -> `[B, T, H, d_v]`:
    query t attends keys `max(0, t - window + 1) .. t`."""
    _check_kv(q, k, v)
    checks.positive_int("window", window)
    out = _run("sliding_window_attention", backend, options, (q, k, v), window=window,
               scale=checks.scale(scale, q.shape[-1]))
    chex.assert_shape(out, (*q.shape[:3], v.shape[-1]))
    chex.assert_type(out, q.dtype)
    return out
