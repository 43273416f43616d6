"""The NSA layer as pure functions over a parameter pytree (spec "The layer").

`init_params(key, cfg)` builds the pytree of DESIGN.md; `nsa_attention(params, x, cfg)` runs
projections, RoPE, the three branches (through `nsa_jax.dispatch`), the gates and the output
projection. The internals `project`, `branches` and `combine` are shared with `nsa_jax.decode`.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from nsa_common import NSAConfig
from nsa_jax import checks, dispatch
from nsa_jax.rope import apply_rope
from nsa_jax.segments import Segments, from_cu_seqlens
from nsa_jax.xla.common import PRECISION

BRANCH_NAMES = ("cmp", "sel", "win")
Params = dict


def kv_names(cfg: NSAConfig) -> tuple[str, ...]:
    """Keys of `params["wk"]` / `params["wv"]`."""
    return ("shared",) if cfg.shared_kv else BRANCH_NAMES


def param_shapes(cfg: NSAConfig) -> dict:
    """The parameter pytree of DESIGN.md with shapes (tuples) as leaves."""
    D, H, G, dk, dv, l = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v,
                          cfg.cmp_block)
    shapes: dict = {
        "wq": (D, H * dk),
        "wk": {name: (D, G * dk) for name in kv_names(cfg)},
        "wv": {name: (D, G * dv) for name in kv_names(cfg)},
        "wg": (D, H * 3),
        "bg": (H * 3,),
        "wo": (H * dv, D),
    }
    if cfg.compress == "mlp":
        for name, dim in (("cmp_k", dk), ("cmp_v", dv)):
            shapes[name] = {"pos": (G, l, dim), "w1": (G, l * dim, dim), "b1": (G, dim),
                            "w2": (G, dim, dim), "b2": (G, dim)}
    return shapes


def init_params(key: jax.Array, cfg: NSAConfig, dtype=jnp.float32) -> Params:
    """Projections `normal(0, 1/sqrt(fan_in))`, `cmp_*.pos` `normal(0, 0.02)`, biases zero.

    Matrices are `[in, out]` (`y = x @ W`); see DESIGN.md for every name and shape.
    """
    checks.config(cfg)
    return _init_params_jit(key, cfg=cfg, dtype=jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _init_params_jit(key, *, cfg: NSAConfig, dtype):
    shapes = param_shapes(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))
    # One draw cut into pieces: a single random-bits kernel compiles far faster than one per leaf.
    sizes = [int(np.prod(shape)) for _, shape in paths]
    pieces = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32),
                       np.cumsum(sizes)[:-1])

    def init(path, shape, noise):
        name = path[-1].key
        if name.startswith("b"):
            return jnp.zeros(shape, dtype)
        std = 0.02 if name == "pos" else 1.0 / np.sqrt(shape[-2])  # fan_in of an [in, out] matrix
        return (std * noise.reshape(shape)).astype(dtype)

    return jax.tree_util.tree_unflatten(
        treedef, [init(path, shape, noise) for (path, shape), noise in zip(paths, pieces)])


def check_params(params: Mapping, cfg: NSAConfig) -> None:
    """ValueError naming the first parameter whose presence or shape differs from DESIGN.md."""
    def walk(expected, actual, where):
        if isinstance(expected, dict):
            if not isinstance(actual, Mapping):
                raise ValueError(f"{where} must be a dict with keys {sorted(expected)}")
            for name, sub in expected.items():
                if name not in actual:
                    raise ValueError(f"{where} lacks {name!r} (expected keys {sorted(expected)})")
                walk(sub, actual[name], f"{where}[{name!r}]")
        elif tuple(getattr(actual, "shape", ())) != expected:
            raise ValueError(f"{where} has shape {getattr(actual, 'shape', None)}, "
                             f"expected {expected}")
    walk(param_shapes(cfg), params, "params")


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` at full precision (no TF32 for float32 on GPUs)."""
    return jnp.matmul(x, w, precision=PRECISION)


def project(params: Params, x: jax.Array, cfg: NSAConfig, positions: jax.Array) -> dict:
    """Spec steps 1-3. x `[B, T, d_model]`, positions int `[T]` (local positions).

    Returns q `[B, T, H, d_k]` and, per branch c in (cmp, sel, win), `k_c [B, T, G, d_k]` and
    `v_c [B, T, G, d_v]`, with RoPE applied to q and every k_c.
    """
    B, T, _ = x.shape
    H, G, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    rope = ((lambda a: a) if cfg.rope_theta is None
            else (lambda a: apply_rope(a, positions, cfg.rope_theta)))
    out = {"q": rope(dense(x, params["wq"]).reshape(B, T, H, dk))}
    kv = {name: (rope(dense(x, params["wk"][name]).reshape(B, T, G, dk)),
                 dense(x, params["wv"][name]).reshape(B, T, G, dv)) for name in kv_names(cfg)}
    for c in BRANCH_NAMES:
        out[f"k_{c}"], out[f"v_{c}"] = kv["shared" if cfg.shared_kv else c]
    return out


def branches(params: Params, proj: dict, cfg: NSAConfig, *, segments: Optional[Segments],
             backend: dispatch.Backend, options: Optional[Mapping[str, Any]]) -> dict:
    """Spec steps 4-8 through the dispatch. -> dict of k_cmp/v_cmp `[B, C, G, d]`, o_cmp, o_sel,
    o_win `[B, T, H, d_v]` and block_idx int32 `[B, T, G, n_sel]`."""
    def run(branch, *args, **kwargs):
        return dispatch.call(branch, backend, *args, segments=segments, options=options,
                             **kwargs)

    mlp = cfg.compress == "mlp"
    q, scale = proj["q"], cfg.scale
    k_cmp = run("compress_kv", proj["k_cmp"], params["cmp_k"] if mlp else None, cfg)
    v_cmp = run("compress_kv", proj["v_cmp"], params["cmp_v"] if mlp else None, cfg)
    o_cmp, lse = run("compressed_attention", q, k_cmp, v_cmp, cfg, scale=scale, return_lse=True)
    block_idx = run("select_blocks", q, k_cmp, cfg, scale=scale, lse=lse)
    return dict(
        k_cmp=k_cmp, v_cmp=v_cmp, block_idx=block_idx, o_cmp=o_cmp,
        o_sel=run("selected_attention", q, proj["k_sel"], proj["v_sel"], block_idx,
                  block_size=cfg.sel_block, scale=scale),
        o_win=run("sliding_window_attention", q, proj["k_win"], proj["v_win"],
                  window=cfg.window, scale=scale),
    )


def combine(params: Params, x: jax.Array, cfg: NSAConfig, o_cmp, o_sel, o_win):
    """Spec steps 9-10. x `[B, T, d_model]`, o_* `[B, T, H, d_v]` ->
    (y `[B, T, d_model]` in x's dtype, gates `[B, T, H, 3]`). Same broadcast for T = 1."""
    B, T, _ = x.shape
    gates = jax.nn.sigmoid(dense(x, params["wg"]) + params["bg"]).reshape(B, T, cfg.n_heads, 3)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win
    y = dense(o.reshape(B, T, cfg.n_heads * cfg.d_v), params["wo"]).astype(x.dtype)
    return y, gates


def check_layer_inputs(params, x, cfg) -> None:
    checks.config(cfg)
    checks.array("x", x, 3)
    if x.shape[-1] != cfg.d_model:
        raise ValueError(f"x has width {x.shape[-1]}, expected d_model = {cfg.d_model}")
    if x.shape[1] < 1:
        raise ValueError("x must hold at least one token (T = 0)")
    check_params(params, cfg)


def check_cu_seqlens(cu_seqlens, x: jax.Array) -> None:
    """Validate `cu_seqlens` `[N + 1]` against x `[1, T, d_model]` (values too when concrete)."""
    checks.array("cu_seqlens", cu_seqlens, 1, floating=False, integer=True)
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs x with batch size 1 (packed), got B = {x.shape[0]}")
    # Traced values are left to the caller (`nsa_jax.check_cu_seqlens` under checkify): a
    # checkify.check here would break every plain `jax.jit` of the layer.
    if checks.concrete(cu_seqlens) is not None or cu_seqlens.shape[0] < 2:
        checks.check_cu_seqlens(cu_seqlens, x.shape[1])


def forward_unchecked(params: Params, x: jax.Array, cu_seqlens, *, cfg: NSAConfig, backend,
                      options, internals: bool = False):
    """The layer on validated inputs. -> (y, aux), plus (proj, parts) with `internals`.
    `options` is `dispatch.static_options(...)` (a tuple of items) or None."""
    options = dict(options) if options else None
    if cu_seqlens is None:
        segments, positions = None, jnp.arange(x.shape[1], dtype=jnp.int32)
    else:
        segments = from_cu_seqlens(cu_seqlens, x.shape[1], cfg)
        positions = segments.pos
    proj = project(params, x, cfg, positions)
    parts = branches(params, proj, cfg, segments=segments, backend=backend, options=options)
    y, gates = combine(params, x, cfg, parts["o_cmp"], parts["o_sel"], parts["o_win"])
    aux = dict(o_cmp=parts["o_cmp"], o_sel=parts["o_sel"], o_win=parts["o_win"], gates=gates,
               block_idx=parts["block_idx"])
    return (y, aux, proj, parts) if internals else (y, aux)


_forward_jit = jax.jit(forward_unchecked,
                       static_argnames=("cfg", "backend", "options", "internals"))


def nsa_attention(params: Params, x: jax.Array, cfg: NSAConfig, *, cu_seqlens=None,
                  backend: dispatch.Backend = "xla", return_aux: bool = False,
                  options: Optional[Mapping[str, Any]] = None):
    """One NSA layer. x `[B, T, d_model]` -> y `[B, T, d_model]` (x's dtype).

    cu_seqlens: int32 `[N + 1]` packing N sequences into `B = 1` (may be traced under jit).
    backend: a registered backend name, or a sequence of names tried in order (fallback).
    options: `{backend name: that backend's options}`, e.g. `{"xla": XlaOptions(...)}`.
    return_aux: also return `aux` = dict(o_cmp, o_sel, o_win `[B, T, H, d_v]`,
    gates `[B, T, H, 3]`, block_idx int32 `[B, T, G, n_sel]`).
    """
    check_layer_inputs(params, x, cfg)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x)
    # Compiled once per static configuration; inlined when the caller is itself under jit.
    y, aux = _forward_jit(params, x, cu_seqlens, cfg=cfg,
                          backend=dispatch.static_backend(backend),
                          options=dispatch.static_options(options))
    B, T, _ = x.shape
    chex.assert_shape(y, x.shape)
    chex.assert_type(y, x.dtype)
    if not return_aux:
        return y
    chex.assert_shape([aux["o_cmp"], aux["o_sel"], aux["o_win"]], (B, T, cfg.n_heads, cfg.d_v))
    chex.assert_shape(aux["gates"], (B, T, cfg.n_heads, 3))
    chex.assert_shape(aux["block_idx"], (B, T, cfg.n_kv_heads, cfg.n_sel))
    return y, aux
