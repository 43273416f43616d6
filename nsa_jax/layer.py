"""The NSA layer as pure functions over a parameter pytree (spec "The layer").

`init_params(key, cfg)` builds the pytree of DESIGN.md; `nsa_attention(params, x, cfg)` runs
the projections, RoPE and the gates, hands the rest to the core (`nsa_jax.core.attend`: the
three branches through `nsa_jax.dispatch`, gated), and applies the output projection. The
internals `project` and `combine` are shared with `nsa_jax.decode`.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from nsa_common import NSAConfig
from nsa_jax import checks, core, dispatch
from nsa_jax.core import BRANCH_NAMES
from nsa_jax.rope import apply_rope
from nsa_jax.segments import from_cu_seqlens
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
    """`x @ w` at the precision of the enclosing `core.precision_scope` (JAX's default without)."""
    return jnp.matmul(x, w)


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


def combine(params: Params, x: jax.Array, cfg: NSAConfig, o_cmp, o_sel, o_win):
    """Spec steps 9-10. x `[B, T, d_model]`, o_* `[B, T, H, d_v]` ->
    (y `[B, T, d_model]` in x's dtype, gates `[B, T, H, 3]`). Same broadcast for T = 1."""
    gates = gate_values(params, x, cfg)
    return output(params, x, cfg, core.mix_branches(gates, o_cmp, o_sel, o_win)), gates


def gate_values(params: Params, x: jax.Array, cfg: NSAConfig) -> jax.Array:
    """Spec step 9's gates: x `[B, T, d_model]` -> sigmoid values `[B, T, H, 3]`."""
    return gates_from_logits(params, dense(x, params["wg"]), cfg)


def gates_from_logits(params: Params, logits: jax.Array, cfg: NSAConfig) -> jax.Array:
    """The gates of logits `x @ wg` `[B, T, 3H]` (decode computes them in its projection GEMM)
    -> sigmoid values `[B, T, H, 3]`."""
    B, T, _ = logits.shape
    dtype = jnp.result_type(logits, params["bg"])
    # At least float32: the bias's gradient sums B*T cotangents, which bfloat16 rounds badly.
    acc = jnp.promote_types(dtype, jnp.float32)
    logits = logits.astype(acc) + params["bg"].astype(acc)
    return jax.nn.sigmoid(logits).astype(dtype).reshape(B, T, cfg.n_heads, 3)


def output(params: Params, x: jax.Array, cfg: NSAConfig, o: jax.Array) -> jax.Array:
    """Spec step 10: o `[B, T, H, d_v]` -> y `[B, T, d_model]` in x's dtype."""
    B, T, _ = x.shape
    return dense(o.reshape(B, T, cfg.n_heads * cfg.d_v), params["wo"]).astype(x.dtype)


def check_layer_inputs(params, x, cfg) -> None:
    checks.config(cfg)
    checks.array("x", x, 3)
    if x.shape[-1] != cfg.d_model:
        raise ValueError(f"x has width {x.shape[-1]}, expected d_model = {cfg.d_model}")
    if x.shape[1] < 1:
        raise ValueError("x must hold at least one token (T = 0)")
    check_params(params, cfg)


def forward_unchecked(params: Params, x: jax.Array, cu_seqlens, block_idx=None, *,
                      cfg: NSAConfig, backend, options, precision: Optional[str] = None,
                      internals: bool = False):
    """The layer on validated inputs. -> (y, aux), plus (proj, parts) with `internals` (parts:
    `core.attend`'s). `options` is `dispatch.static_options(...)` (a tuple of items) or None;
    `precision` is `core.check_precision(...)`'s."""
    with core.precision_scope(precision):
        if cu_seqlens is None:
            segments, positions = None, jnp.arange(x.shape[1], dtype=jnp.int32)
        else:
            segments = from_cu_seqlens(cu_seqlens, x.shape[1], cfg)
            positions = segments.pos
        proj = project(params, x, cfg, positions)
        gates = gate_values(params, x, cfg)
        mlp = cfg.compress == "mlp"
        o, parts = core.attend(
            proj["q"], {c: (proj[f"k_{c}"], proj[f"v_{c}"]) for c in BRANCH_NAMES}, gates,
            {"cmp_k": params["cmp_k"], "cmp_v": params["cmp_v"]} if mlp else None, cfg,
            scale=cfg.scale, segments=segments, backend=backend,
            options=dict(options) if options else None, block_idx=block_idx)
        y = output(params, x, cfg, o)
    aux = dict(o_cmp=parts["o_cmp"], o_sel=parts["o_sel"], o_win=parts["o_win"], gates=gates,
               block_idx=parts["block_idx"])
    return (y, aux, proj, parts) if internals else (y, aux)


_forward_jit = jax.jit(forward_unchecked,
                       static_argnames=("cfg", "backend", "options", "precision", "internals"))


def nsa_attention(params: Params, x: jax.Array, cfg: NSAConfig, *, cu_seqlens=None,
                  backend: dispatch.Backend = "xla", return_aux: bool = False,
                  options: Optional[Mapping[str, Any]] = None, precision: core.Precision = None,
                  block_idx: Optional[jax.Array] = None):
    """One NSA layer. x `[B, T, d_model]` -> y `[B, T, d_model]` (x's dtype).

    cu_seqlens: int `[N + 1]` packing N sequences into `B = 1`: a JAX array (may be traced
    under jit) or a list / NumPy array of ints.
    backend: a registered backend name, or a sequence of names tried in order (fallback);
    `"pallas"` runs the Pallas kernels where they exist and XLA for the other branches.
    options: `{backend name: that backend's options}`, e.g. `{"xla": XlaOptions(...)}`.
    precision: of the projections and the XLA branches' matmuls: None (default) keeps JAX's
    default for the dtype (TF32 for float32 on recent GPUs) or the caller's
    `jax.default_matmul_precision`; `"highest"` / `jax.lax.Precision.HIGHEST` gives IEEE float32.
    block_idx: int `[B, T, G, n_sel]` selection blocks the selected branch attends to instead
    of the layer's own selection (see `native_sparse_attention`); equal to the layer's own, it
    changes nothing.
    return_aux: also return `aux` = dict(o_cmp, o_sel, o_win `[B, T, H, d_v]`,
    gates `[B, T, H, 3]`, block_idx int32 `[B, T, G, n_sel]`).
    """
    x = core.as_jax_array(x)
    check_layer_inputs(params, x, cfg)
    if cu_seqlens is not None:
        cu_seqlens = core.as_cu_seqlens(cu_seqlens)
        core.check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], "x")
    # Compiled once per static configuration; inlined when the caller is itself under jit.
    block_idx = core.check_block_idx(block_idx, x.shape[:2], cfg.n_kv_heads, cfg)
    y, aux = _forward_jit(params, x, cu_seqlens, block_idx, cfg=cfg,
                          backend=dispatch.static_backend(backend),
                          options=dispatch.static_options(options),
                          precision=core.check_precision(precision))
    B, T, _ = x.shape
    chex.assert_shape(y, x.shape)
    chex.assert_type(y, x.dtype)
    if not return_aux:
        return y
    chex.assert_shape([aux["o_cmp"], aux["o_sel"], aux["o_win"]], (B, T, cfg.n_heads, cfg.d_v))
    chex.assert_shape(aux["gates"], (B, T, cfg.n_heads, 3))
    chex.assert_shape(aux["block_idx"], (B, T, cfg.n_kv_heads, cfg.n_sel))
    return y, aux
