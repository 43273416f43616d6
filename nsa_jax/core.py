"""The NSA attention core over projected tensors: the one place that composes the three branches.

`native_sparse_attention(q, k, v, gates, cfg)` is for models that own their projections and RoPE
(the counterpart of fla's `parallel_nsa`): spec steps 4-9 on q `[B, T, H, d_k]`, keys and values
per branch (or one pair shared by the branches) and the gates. `nsa_jax.layer` (and through it
decode's prefill) runs the same `attend` / `mix_branches`, so nothing else composes the branches.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping, Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsa_common import NSAConfig
from nsa_common.layout import num_sel_blocks
from nsa_jax import checks, dispatch
from nsa_jax.segments import Segments, from_cu_seqlens

BRANCH_NAMES = ("cmp", "sel", "win")
ArrayOrBranches = Union[jax.Array, Mapping[str, jax.Array]]
Precision = Union[None, str, lax.Precision]

# The names `jax.default_matmul_precision` accepts; `lax.Precision` members map onto the first three.
PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


# -- precision -----------------------------------------------------------------------------------
def check_precision(precision: Precision) -> Optional[str]:
    """`precision` as a hashable name for `jax.default_matmul_precision`, or None (keep JAX's
    default for the dtype, or whatever the caller's own `jax.default_matmul_precision` says)."""
    if precision is None:
        return None
    if isinstance(precision, lax.Precision):
        return precision.name.lower()
    if isinstance(precision, str) and precision.lower() in PRECISION_NAMES:
        return precision.lower()
    raise ValueError(f"precision ({precision!r}) must be None, a jax.lax.Precision or one of "
                     f"{list(PRECISION_NAMES)}")


def precision_scope(precision: Optional[str]):
    """A context in which every matmul without its own precision (the layer's, the XLA
    branches') runs at `precision`. Entered while tracing: it lands in each dot's parameters and
    in the cache key of every nested `jit`, backward pass included."""
    return (contextlib.nullcontext() if precision is None
            else jax.default_matmul_precision(precision))


# -- cu_seqlens ----------------------------------------------------------------------------------
def as_cu_seqlens(cu_seqlens):
    """A list, tuple or NumPy array of integers -> an int32 `jax.Array`; JAX arrays (possibly
    traced) pass through unchanged and are checked by `check_cu_seqlens`."""
    if isinstance(cu_seqlens, (list, tuple, np.ndarray)):
        values = np.asarray(cu_seqlens)
        if values.size and values.dtype.kind not in "iu":
            raise ValueError(f"cu_seqlens must hold integers (e.g. jnp.array([0, 32, 64], "
                             f"jnp.int32)), got {values.dtype}")
        return jnp.asarray(values, jnp.int32)
    return cu_seqlens


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int, input_name: str) -> None:
    """Validate `cu_seqlens` `[N + 1]` packing N sequences into input `[1, seq_len, ...]`
    (values too when they are concrete)."""
    checks.array("cu_seqlens", cu_seqlens, 1, floating=False, integer=True)
    if batch != 1:
        raise ValueError(f"cu_seqlens needs {input_name} with batch size 1 (packed), got "
                         f"B = {batch}")
    if cu_seqlens.shape[0] < 2 or checks.concrete(cu_seqlens) is not None:
        # Traced values are left to the caller (`nsa_jax.check_cu_seqlens` under checkify): a
        # checkify.check here would break every plain `jax.jit` of the layer.
        checks.check_cu_seqlens(cu_seqlens, seq_len)


def as_jax_array(x):
    """A NumPy array as the JAX array `jnp.asarray` makes of it (float64 becomes float32 while
    x64 is off), so that an output "in x's dtype" has the dtype the computation ran in; anything
    else (JAX arrays, tracers, invalid inputs left to the checks) passes through."""
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


# -- the composition (validated inputs) -----------------------------------------------------------
def attend(q: jax.Array, kv: Mapping[str, tuple[jax.Array, jax.Array]], gates: jax.Array,
           cmp_params: Optional[Mapping[str, Any]], cfg: NSAConfig, *, scale: float,
           segments: Optional[Segments], backend: dispatch.Backend,
           options: Optional[Mapping[str, Any]],
           block_idx: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
    """Spec steps 4-9 through the dispatch.

    q `[B, T, H, d_k]`; kv: per branch c in (cmp, sel, win) `(k_c [B, T, G, d_k], v_c
    [B, T, G, d_v])`; gates `[B, T, H, 3]` (values, not logits); cmp_params: `{"cmp_k",
    "cmp_v"}` (`compress="mlp"`) or None. -> (o `[B, T, H, d_v]` unrounded: the promotion of the
    gates' and branch outputs' dtypes, parts): parts holds k_cmp / v_cmp `[B, C, G, d]`, o_cmp,
    o_sel, o_win `[B, T, H, d_v]`, lse `[B, T, H]` and block_idx int32 `[B, T, G, n_sel]`.
    block_idx: given (int32 `[B, T, G, n_sel]`), the selected branch attends to these blocks and
    the selection is skipped (a shared selection for parity checks).
    """
    def run(branch, *args, **kwargs):
        return dispatch.call(branch, backend, *args, segments=segments, options=options,
                             **kwargs)

    mlp = cfg.compress == "mlp"
    k_cmp = run("compress_kv", kv["cmp"][0], cmp_params["cmp_k"] if mlp else None, cfg)
    v_cmp = run("compress_kv", kv["cmp"][1], cmp_params["cmp_v"] if mlp else None, cfg)
    o_cmp, lse = run("compressed_attention", q, k_cmp, v_cmp, cfg, scale=scale, return_lse=True)
    # Only where the library computes the selection: a caller's own selection backend (e.g. one
    # that takes blocks out) or selected branch always runs.
    every_block = (block_idx is None and selects_every_block(cfg, q.shape[1])
                   and dispatch.library_only("select_blocks", backend)
                   and dispatch.library_only("selected_attention", backend))
    if every_block:
        # Every block a query may see is selected: the selection needs no scores (its blocks
        # are every eligible one, in order), and the selected branch is causal attention,
        # which the window branch's path with w = T computes flash-style (cuDNN / FA-3 / the
        # Pallas window kernel) instead of gathering blocks.
        block_idx = every_block_idx(q.shape[0], q.shape[1], k_cmp.shape[2], cfg, segments)
        o_sel = run("sliding_window_attention", q, *kv["sel"], window=q.shape[1], scale=scale)
    else:
        if block_idx is None:
            # Selection reuses the compressed branch's lse: backends that normalise with it
            # (Pallas) would otherwise run the compressed scores a second time.
            block_idx = run("select_blocks", q, k_cmp, cfg, scale=scale, lse=lse)
        o_sel = run("selected_attention", q, *kv["sel"], block_idx, block_size=cfg.sel_block,
                    scale=scale)
    o_win = run("sliding_window_attention", q, *kv["win"], window=cfg.window, scale=scale)
    parts = dict(k_cmp=k_cmp, v_cmp=v_cmp, o_cmp=o_cmp, lse=lse, block_idx=block_idx,
                 o_sel=o_sel, o_win=o_win)
    return mix_branches(gates, o_cmp, o_sel, o_win), parts


def selects_every_block(cfg: NSAConfig, seq_len: int) -> bool:
    """Whether every query of a sequence of `seq_len` tokens (or of one packed into it) selects
    every block it may see: n_sel covers the blocks of seq_len tokens (the T 512 stage of a
    short schedule, or `nsa_jax.dense_warmup_config`'s warm-up)."""
    return cfg.n_sel >= num_sel_blocks(cfg, seq_len)


def every_block_idx(batch: int, seq_len: int, n_kv_heads: int, cfg: NSAConfig,
                    segments: Optional[Segments]) -> jax.Array:
    """The selection where n_sel covers every block (`selects_every_block`), spec step 6 without
    scores: query t takes blocks 0 .. pos(t) // l_sel in ascending order, -1 after (pos: its
    position inside its own sequence). -> int32 `[batch, seq_len, n_kv_heads, n_sel]`."""
    pos = segments.pos if segments is not None else jnp.arange(seq_len, dtype=jnp.int32)
    j = jnp.arange(cfg.n_sel, dtype=jnp.int32)
    idx = jnp.where(j[None, :] <= (pos // cfg.sel_block)[:, None], j[None, :], -1)
    return jnp.broadcast_to(idx[None, :, None, :], (batch, seq_len, n_kv_heads, cfg.n_sel))


def check_block_idx(block_idx, rows: tuple[int, int], n_kv_heads: int, cfg: NSAConfig):
    """None, or a given block_idx as int32 after a ValueError check of its shape `[*rows, G,
    n_sel]` (rows: the queries' `(B, T)`)."""
    if block_idx is None:
        return None
    checks.array("block_idx", block_idx, 4, floating=False, integer=True)
    expected = (*rows, n_kv_heads, cfg.n_sel)
    if tuple(block_idx.shape) != expected:
        raise ValueError(f"block_idx has shape {tuple(block_idx.shape)}, expected {expected} "
                         f"[B, T, G, n_sel]")
    return jnp.asarray(block_idx, jnp.int32)


def mix_branches(gates: jax.Array, o_cmp: jax.Array, o_sel: jax.Array,
                 o_win: jax.Array) -> jax.Array:
    """Spec step 9: gates `[B, T, H, 3]` (cmp, sel, win) times o_* `[B, T, H, d_v]`, summed.
    The same broadcast serves prefill and decode (T = 1)."""
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win


def _core_unchecked(q, kv, gates, cmp_params, cu_seqlens, block_idx, *, cfg: NSAConfig,
                    scale: float, gates_are_logits: bool, backend, options, precision):
    with precision_scope(precision):
        segments = None if cu_seqlens is None else from_cu_seqlens(cu_seqlens, q.shape[1], cfg)
        if gates_are_logits:
            gates = jax.nn.sigmoid(gates)
        o, parts = attend(q, kv, gates, cmp_params, cfg, scale=scale, segments=segments,
                          backend=backend, options=dict(options) if options else None,
                          block_idx=block_idx)
    return o.astype(q.dtype), dict(parts, gates=gates)


_core_jit = jax.jit(_core_unchecked, static_argnames=("cfg", "scale", "gates_are_logits",
                                                      "backend", "options", "precision"))


# -- the public function ---------------------------------------------------------------------------
def _per_branch(name: str, value: ArrayOrBranches) -> dict:
    """One array shared by the branches, or a mapping with exactly the keys cmp, sel, win."""
    if isinstance(value, Mapping):
        if set(value) != set(BRANCH_NAMES):
            raise ValueError(f"{name} must be one array shared by the branches or a dict with "
                             f"keys {list(BRANCH_NAMES)}, got keys {sorted(value)}")
        return {c: value[c] for c in BRANCH_NAMES}
    return {c: value for c in BRANCH_NAMES}


def _check_core_inputs(q, k: dict, v: dict, gates, cmp_params, cfg: NSAConfig) -> None:
    checks.config(cfg)
    checks.array("q", q, 4)
    B, T, H, d_k = q.shape
    for c in BRANCH_NAMES:
        k_name, v_name = f"k[{c!r}]", f"v[{c!r}]"
        checks.array(k_name, k[c], 4)
        checks.array(v_name, v[c], 4)
        checks.dim(k_name, tuple(k[c].shape[:2]), (B, T), "[B, T]")
        checks.dim(k_name, k[c].shape[3], d_k, "head dim (q's d_k)")
        checks.dim(v_name, tuple(v[c].shape[:3]), tuple(k[c].shape[:3]), "[B, T, G]")
        checks.dim(k_name, tuple(k[c].shape), tuple(k["cmp"].shape), "shape (k['cmp']'s)")
        checks.dim(v_name, tuple(v[c].shape), tuple(v["cmp"].shape), "shape (v['cmp']'s)")
    checks.queries("q", q, n_kv_heads=k["cmp"].shape[2])
    checks.array("gates", gates, 4)
    checks.dim("gates", tuple(gates.shape), (B, T, H, 3), "shape")
    if cfg.compress == "mlp" and not isinstance(cmp_params, Mapping):
        raise ValueError("cmp_params must be {'cmp_k': ..., 'cmp_v': ...} (the layer's "
                         "compression MLPs) with compress='mlp'; pass cfg.replace("
                         "compress='mean') for parameter-free mean pooling")
    if cfg.compress == "mean" and cmp_params is not None:
        raise ValueError("cmp_params must be None with compress='mean'")
    if cmp_params is not None:
        G, d_v = k["cmp"].shape[2], v["cmp"].shape[3]
        for name, dim in (("cmp_k", d_k), ("cmp_v", d_v)):
            checks.cmp_params(f"cmp_params[{name!r}]", cmp_params.get(name), cfg, G, dim)


def native_sparse_attention(q: jax.Array, k: ArrayOrBranches, v: ArrayOrBranches,
                            gates: jax.Array, cfg: NSAConfig, *,
                            cmp_params: Optional[Mapping[str, Any]] = None,
                            gates_are_logits: bool = False, cu_seqlens=None,
                            scale: Optional[float] = None,
                            backend: dispatch.Backend = "xla",
                            options: Optional[Mapping[str, Any]] = None,
                            precision: Precision = None, return_aux: bool = False,
                            block_idx: Optional[jax.Array] = None):
    """NSA attention on projected (and already RoPE'd) tensors: `o = sum_c gates[..., c] * o_c`.

    q: `[B, T, H, d_k]`.
    k, v: `[B, T, G, d_k]` / `[B, T, G, d_v]` shared by the three branches, or dicts
        `{"cmp": ..., "sel": ..., "win": ...}` of such arrays (the paper's separate keys and
        values per branch). H must be a multiple of G (grouped-query attention).
    gates: `[B, T, H, 3]`, the weights of the (cmp, sel, win) branches; values in [0, 1] (the
        spec's sigmoid already applied) unless `gates_are_logits=True`.
    cfg: the NSA hyperparameters (block sizes, n_sel, window, compress); its head counts and
        dims are not used, the arrays' shapes are.
    cmp_params: `{"cmp_k": {pos, w1, b1, w2, b2}, "cmp_v": {...}}` (the layer's entries of
        those names) with `cfg.compress == "mlp"`; None with `compress == "mean"`.
    cu_seqlens: int `[N + 1]` packing N sequences into `B = 1` (a JAX array, possibly traced,
        or a list / NumPy array of ints).
    scale: softmax scale, default `1 / sqrt(d_k)`.
    backend: a registered name or a sequence tried in order; `"pallas"` runs the Pallas kernels
        where they exist and XLA for the other branches (see `nsa_jax.dispatch`).
    options: `{backend name: its options}` (`XlaOptions`, `PallasOptions`).
    precision: of the matmuls without their own (XLA branches): None keeps JAX's default for
        the dtype (TF32 for float32 on recent GPUs); `"highest"` gives IEEE float32.
    block_idx: int `[B, T, G, n_sel]` selection blocks to attend to instead of the selection's
        own (ascending, -1 padded, as `select_blocks` returns them; per packed sequence, local
        block indices): the parity report forces both frameworks onto one selection this way.
    return_aux: also return `aux`: o_cmp, o_sel, o_win `[B, T, H, d_v]`, gates `[B, T, H, 3]`
        (values), block_idx int32 `[B, T, G, n_sel]`, lse `[B, T, H]` (the compressed branch's
        log-sum-exp, float32; -inf where no block is admissible), k_cmp / v_cmp `[B, C, G, d]`.

    -> o `[B, T, H, d_v]` in q's dtype (and aux).
    """
    q = as_jax_array(q)
    k, v = _per_branch("k", k), _per_branch("v", v)
    _check_core_inputs(q, k, v, gates, cmp_params, cfg)
    B, T, H, d_k = q.shape
    if cu_seqlens is not None:
        cu_seqlens = as_cu_seqlens(cu_seqlens)
        check_cu_seqlens(cu_seqlens, B, T, "q")
    kv = {c: (k[c], v[c]) for c in BRANCH_NAMES}
    block_idx = check_block_idx(block_idx, (B, T), k["cmp"].shape[2], cfg)
    o, aux = _core_jit(q, kv, gates, cmp_params, cu_seqlens, block_idx, cfg=cfg,
                       scale=checks.scale(scale, d_k), gates_are_logits=bool(gates_are_logits),
                       backend=dispatch.static_backend(backend),
                       options=dispatch.static_options(options),
                       precision=check_precision(precision))
    d_v = v["cmp"].shape[3]
    chex.assert_shape(o, (B, T, H, d_v))
    chex.assert_type(o, q.dtype)
    if not return_aux:
        return o
    chex.assert_shape([aux["o_cmp"], aux["o_sel"], aux["o_win"]], (B, T, H, d_v))
    chex.assert_shape(aux["lse"], (B, T, H))
    chex.assert_shape(aux["block_idx"], (B, T, k["cmp"].shape[2], cfg.n_sel))
    return o, aux
