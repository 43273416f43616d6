"""cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for the
branches whose mask it can express: the sliding window (its `local_window_size`) and the
compressed branch, whose mask becomes cuDNN's causal square after a reshape of the queries.

Compressed branch (spec step 5): query `t` may attend compressed blocks `0 .. n(t) - 1` with
`n(t) = (t - l + 1) // d + 1`. Cut the queries from `t = l - 1` on into chunks of `d`: every
query of chunk `c` (tokens `l - 1 + c*d + r`, `r < d`) attends exactly the blocks `0 .. c`. So
with the chunk's `d` tokens folded into the head axis, `q` becomes `[B, C, G * d * h, d_k]`
against the `C` compressed keys `[B, C, G, d_k]`, and the mask is the causal one of a `C x C`
square (GQA: each KV head serves `d * h` query "heads"). The queries `t < l - 1` see no block:
`o = 0`, `lse = -inf`, as the kernels give.

FlashAttention-3 (`flash_attn3_jax`, optional, Hopper and later) takes the same two forms where
it is installed: `fa3_takes`, `fa3_window_attention`, `fa3_causal_attention` (the `fa3` option
of `XlaOptions` and `PallasOptions`, on by default). On an H200 it ran the 64k window branch in
2.81 / 12.32 ms (cuDNN 3.25 / 14.12) and the folded compressed branch in 8.10 / 29.34 ms
(cuDNN 8.33 / 33.57), forward / forward+backward (bench/RESULTS.md).
"""
from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from nsa_common import NSAConfig, num_cmp_blocks

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_MAX_HEAD_DIM_SM90 = 256    # Hopper and later (the paper's d_k = 192)


def max_head_dim() -> int:
    """cuDNN's head-size limit on this machine's architecture profile (`NSA_PROFILE`, else the
    device's compute capability: `pallas_kernels.profiles`), so that `NSA_PROFILE=sm89` makes
    an RTX 4090's choices on any GPU."""
    from pallas_kernels import profiles

    return profiles.current().cudnn_max_head_dim


def takes(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether cuDNN's flash attention can take these arrays on this machine: a GPU, bf16 /
    fp16 throughout, a head size that is a multiple of 8, `d_v <= d_k` (`d_v < d_k` goes in as
    it is where `cudnn_mla()`, else with v zero-padded to d_k)."""
    return (jax.default_backend() == "gpu" and q.dtype in CUDNN_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and v.shape[-1] <= q.shape[-1]
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= max_head_dim())


@functools.lru_cache(maxsize=None)
def _cudnn_private():
    """jax's own cuDNN attention below `jax.nn.dot_product_attention`: (function, MaskType),
    or None. The public call refuses `d_v != d_k` (jax 0.11.2: "value shape should be
    [.., d_k]") although this function and cuDNN take it. Private, so
    every use falls back to the public call if it is missing or refuses its arguments."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as private
        return private.dot_product_attention, private.MaskType
    except (ImportError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def cudnn_mla() -> bool:
    """Whether cuDNN can take `d_v < d_k` without padding v here: jax's "MLA" form, which asks
    for a Hopper or later GPU, cuDNN >= 9.10 and jax's private cuDNN function. Unpadded, the
    `p @ v` products and dv of the paper's 192 / 128 heads are a third smaller."""
    if max_head_dim() != _MAX_HEAD_DIM_SM90 or _cudnn_private() is None:
        return False
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        return check_cudnn_version() >= 91000
    except Exception:  # no cuDNN, or a jax without this private helper: pad as before
        return False


def _cudnn_attention(q, k, v, scale: float, *, window: int | None, residual: bool,
                     mla: bool | None):
    """Causal cuDNN attention (keys `t - window + 1 .. t` where `window`): o `[B, S, N, d_v]`,
    and with `residual` the lse `[B, S, N]` float32 too.

    `d_v < d_k` goes in unpadded where `mla` (None: `cudnn_mla()`), else with v padded to d_k.
    jax's private function takes the unpadded form, and every call that wants the lse: the
    public `jax.nn.dot_product_attention` returns the lse cast to q's dtype (bf16: about 3
    significant digits, which the selection's `exp(s - lse)` would inherit). Elsewhere, and
    wherever the private function is missing or refuses its arguments, the public call runs."""
    d_k, d_v = q.shape[-1], v.shape[-1]
    unpadded = d_v == d_k or (cudnn_mla() if mla is None else mla)
    value = v if unpadded else pad_v(v, d_k)
    out, private = None, _cudnn_private()
    if in_manual_region() and unpartitioned_ready():
        out = _unpartitioned_attention(q, k, value, float(scale), window)
        out = out if residual else out[0]
    elif private is not None and (residual or (d_v < d_k and unpadded)):
        fn, mask_type = private
        try:
            out = fn(query=q, key=k, value=value, scale=scale, mask_type=mask_type.CAUSAL,
                     sliding_window_length=window, return_residual=residual)
        except (TypeError, ValueError, NotImplementedError) as exc:
            _warn_private_fallback(exc)
    if out is not None:       # jax's primitives, through its private function or below it
        if residual:
            o, lse = out
            return o[..., :d_v], jnp.swapaxes(lse, 1, 2)   # cuDNN's residual is [B, N, S]
        return out[..., :d_v]
    out = jax.nn.dot_product_attention(
        q, k, pad_v(v, d_k), scale=scale, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0),
        return_residual=residual)
    if residual:
        return out[0][..., :d_v], out[1].astype(jnp.promote_types(out[1].dtype, jnp.float32))
    return out[..., :d_v]


def in_manual_region() -> bool:
    """Whether this trace is inside a `shard_map` whose every mesh axis is manual (local arrays,
    nothing for XLA's partitioner to do)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names)


# The parameters of jax's cuDNN primitives' implementations (jax 0.10.2 to 0.11.2), below the
# `custom_partitioning` that jax wraps them in.
_FWD_PARAMS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
               "kv_offsets", "page_table_k", "page_table_v", "scale", "seed", "dropout_rate",
               "variadic_args", "mask_type", "layout", "sliding_window_length", "is_training")
_BWD_PARAMS = _FWD_PARAMS[:10] + ("activation", "fwd_output", "grad_output") + tuple(
    p for p in _FWD_PARAMS[10:] if p != "is_training")


@functools.lru_cache(maxsize=None)
def _unpartitioned_ops():
    """(forward, backward, causal mask, BTNH layout) of jax's cuDNN attention primitives as
    bound below their `custom_partitioning`, or None where this jax lays them out otherwise."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as private
        fwd = private._dot_product_attention_fwd_impl
        bwd = private._dot_product_attention_bwd_impl
        if (tuple(inspect.signature(fwd).parameters) != _FWD_PARAMS
                or tuple(inspect.signature(bwd).parameters) != _BWD_PARAMS):
            return None
        return fwd, bwd, private.MaskType.CAUSAL, private._normalize_layout("BTNH").value
    except (ImportError, AttributeError, KeyError, ValueError, TypeError):
        return None


def unpartitioned_ready() -> bool:
    """Whether cuDNN's attention can be called without jax's `custom_partitioning` wrapper
    (`_unpartitioned_attention`), which a multi-device `shard_map` needs."""
    return _unpartitioned_ops() is not None


def _unpartitioned_static(window):
    _, _, causal, layout = _unpartitioned_ops()
    return dict(seed=0, dropout_rate=0.0, variadic_args=(False, False), mask_type=causal,
                layout=layout, sliding_window_length=window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _unpartitioned_attention(q, k, v, scale: float, window):
    """Causal cuDNN attention (window as in `_cudnn_attention`) -> (o, lse `[B, N, S]`), bound
    straight to jax's cuDNN primitives. jax wraps them in `custom_partitioning` so that GSPMD can
    split them; inside a multi-device `shard_map` the arrays are local and that wrapper is what
    made XLA's compile of the layer's gradient segfault (jax 0.11.2, in its Shardy-to-HLO
    conversion; scripts/repro_cudnn_shard_map.py). As in jax's own call, the lse takes no
    cotangent."""
    return _unpartitioned_fwd(q, k, v, scale, window)[0]


def _unpartitioned_fwd(q, k, v, scale, window):
    fwd = _unpartitioned_ops()[0]
    empty = jnp.zeros(0, q.dtype)
    o, lse = fwd(q, k, v, *(empty,) * 7, scale=scale, is_training=True,
                 **_unpartitioned_static(window))
    return (o, lse), (q, k, v, o, lse)


def _unpartitioned_bwd(scale, window, residuals, cotangents):
    q, k, v, o, lse = residuals
    bwd = _unpartitioned_ops()[1]
    empty = jnp.zeros(0, q.dtype)
    dq, dk, dv = bwd(q, k, v, *(empty,) * 7, lse, o, cotangents[0].astype(o.dtype),
                     scale=scale, **_unpartitioned_static(window))[:3]
    return dq, dk, dv


_unpartitioned_attention.defvjp(_unpartitioned_fwd, _unpartitioned_bwd)


def _warn_private_fallback(exc) -> None:
    warnings.warn(f"jax's private cuDNN attention refused its arguments ({type(exc).__name__}: "
                  f"{exc}); running jax.nn.dot_product_attention with v padded to d_k",
                  RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _fa3_ops():
    """(forward, backward) of flash_attn3_jax's attention primitives, or None where the package
    (or this layout of it: the forward that also returns lse) is not installed."""
    try:
        from flash_attn3_jax import flash as fa3
        return fa3._flash_mha_fwd, fa3._flash_mha_bwd
    except (ImportError, AttributeError, OSError, RuntimeError):  # absent, or its CUDA libraries
        return None


_FA3_MAX_HEAD_DIM = 128  # flash_attn3_jax 0.2.3's build: "head dimension at most 128"


def fa3_takes(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether FlashAttention-3 can take these arrays: `takes` on a Hopper or later GPU with
    `flash_attn3_jax` installed, head size <= 128 (the paper's d_k = 192 stays on cuDNN)."""
    from pallas_kernels import profiles

    return (takes(q, k, v) and q.shape[-1] <= _FA3_MAX_HEAD_DIM and profiles.current().fa3
            and _fa3_ops() is not None)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes (inside `shard_map`) over which x's value varies, by its type."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)      # jax >= 0.10
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _varying_like(outputs, *operands):
    """flash_attn3_jax's calls type their results as varying over no mesh axis; inside a
    `shard_map` they vary as their operands do, and a custom VJP's cotangents must say so
    (else JAX refuses the backward, or psums over the axis what it takes for a broadcast).
    The cast changes the type only; it sits inside the custom VJP, so it is never
    differentiated."""
    axes = frozenset().union(*map(_varying_axes, operands))
    return tuple(_cast_varying(y, tuple(sorted(axes - _varying_axes(y)))) for y in outputs)


def _cast_varying(y, axes: tuple):
    if not axes:
        return y
    if hasattr(lax, "pcast"):                                  # jax >= 0.8
        return lax.pcast(y, axes, to="varying")
    return lax.pvary(y, axes)


def _fa3_forward(q, k, v, scale, window):
    o, lse = _fa3_ops()[0](q, k, v, softmax_scale=scale, is_causal=True, window_size=window)
    return _varying_like((o, lse), q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fa3_attention(q, k, v, scale, window):
    return _fa3_forward(q, k, v, scale, window)


def _fa3_attention_fwd(q, k, v, scale, window):
    o, lse = _fa3_forward(q, k, v, scale, window)
    return (o, lse), (q, k, v, o, lse)


def _fa3_attention_bwd(scale, window, residuals, cotangents):
    q, k, v, o, lse = residuals
    do, _ = cotangents  # lse carries no gradient (its callers stop it)
    grads = _fa3_ops()[1](do.astype(o.dtype), q, k, v, o, lse, softmax_scale=scale,
                          is_causal=True, window_size=window)
    return tuple(_varying_like((grad,), x)[0] for grad, x in zip(grads, (q, k, v)))


_fa3_attention.defvjp(_fa3_attention_fwd, _fa3_attention_bwd)


def fa3_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float):
    """FlashAttention-3's causal attention with the signature of `causal_attention`: q
    `[B, S, N, d]`, k / v `[B, S, N_kv, d]` (`d_v <= d_k`: this build takes one head size, so v
    is padded) -> (o `[B, S, N, d_v]`, lse `[B, S, N]` float32); the lse carries no gradient.
    The caller checks `fa3_takes`."""
    o, lse = _fa3_attention(q, k, pad_v(v, q.shape[-1]), float(scale), (-1, -1))
    return o[..., :v.shape[-1]], lax.stop_gradient(jnp.swapaxes(lse, 1, 2))


def fa3_window_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int,
                         scale: float) -> jax.Array:
    """The sliding window on FlashAttention-3: query t attends keys `t - w + 1 .. t`. q
    `[B, T, H, d_k]`, k `[B, T, G, d_k]`, v `[B, T, G, d_v <= d_k]` -> `[B, T, H, d_v]`.
    The caller checks `fa3_takes`."""
    o, _ = _fa3_attention(q, k, pad_v(v, q.shape[-1]), float(scale), (window - 1, 0))
    return o[..., :v.shape[-1]]


def fused_takes(q: jax.Array, k: jax.Array, v: jax.Array, *, fa3: bool,
                cudnn_kernel: bool) -> bool:
    """Whether a fused path takes these arrays: `takes`, and then FlashAttention-3 (`fa3` asked
    for and `fa3_takes`) or, where `cudnn_kernel` allows it, cuDNN's own kernel."""
    return takes(q, k, v) and (cudnn_kernel or (fa3 and fa3_takes(q, k, v)))


def window_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, scale: float,
                     fa3: bool = True, mla: bool | None = None) -> jax.Array:
    """The sliding window on fused attention: FlashAttention-3 where `fa3` is asked for and
    `fa3_takes` the arrays, else cuDNN's `local_window_size` (v unpadded where `mla`, None:
    `cudnn_mla()`). Shapes as `fa3_window_attention`; the caller checks `takes`."""
    if fa3 and fa3_takes(q, k, v):
        return fa3_window_attention(q, k, v, window=window, scale=scale)
    return _cudnn_attention(q, k, v, scale, window=window, residual=False, mla=mla)


def fused_causal(fa3: bool, q: jax.Array, k: jax.Array, v: jax.Array):
    """The causal attention the compressed branch's folded form runs on: FlashAttention-3 where
    `fa3` is asked for and `fa3_takes` the arrays, else cuDNN."""
    return fa3_causal_attention if fa3 and fa3_takes(q, k, v) else causal_attention


def pad_v(v: jax.Array, d_k: int) -> jax.Array:
    d_v = v.shape[-1]
    return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, d_k - d_v)]) if d_v < d_k else v


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, *,
                     mla: bool | None = None):
    """cuDNN's causal attention, q `[B, S, N, d_k]`, k `[B, S, N_kv, d_k]`, v
    `[B, S, N_kv, d_v <= d_k]` -> (o `[B, S, N, d_v]`, lse `[B, S, N]`); v unpadded where `mla`
    (None: `cudnn_mla()`)."""
    return _cudnn_attention(q, k, v, scale, window=None, residual=True, mla=mla)


def compressed_attention(q: jax.Array, k_cmp: jax.Array, v_cmp: jax.Array, cfg: NSAConfig, *,
                         scale: float, attend=causal_attention):
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]`, v_cmp `[B, C, G, d_v]` ->
    (o_cmp `[B, T, H, d_v]` in q's dtype, lse `[B, T, H]` float32 or wider).

    The caller checks `takes(q, k_cmp, v_cmp)`. `lse` carries no gradient (it feeds the
    selection, whose block indices have none); the Pallas kernel's does, for callers that need it.
    Raises NotImplementedError where the reshape does not apply (fewer than `C(T)` blocks).
    `attend` is the causal attention run on the folded arrays (tests pass a float64 one); it
    takes v at its own d_v and returns o at d_v.
    """
    B, T, H, d_k = q.shape
    G, d_v = k_cmp.shape[2], v_cmp.shape[-1]
    h, l, d = H // G, cfg.cmp_block, cfg.cmp_stride
    n = num_cmp_blocks(cfg, T)
    if n == 0 or k_cmp.shape[1] < n:
        raise NotImplementedError(f"the cuDNN compressed path needs the {n} compressed blocks "
                                  f"of T = {T} (got {k_cmp.shape[1]})")
    rows = T - (l - 1)                                   # queries that see at least block 0
    # cuDNN's backward takes even sequence lengths only: one more chunk and block when n is odd.
    # Rows c < n see blocks <= c < n only, and the extra row's output (cut) has no cotangent.
    n_sq = n + n % 2
    q_rows = jnp.pad(q[:, l - 1:], [(0, 0), (0, n_sq * d - rows), (0, 0), (0, 0)])
    # [B, n_sq, d, G, h, d_k] -> [B, n_sq, G, d, h, d_k]: the heads of KV group g stay together.
    q_sq = q_rows.reshape(B, n_sq, d, G, h, d_k).transpose(0, 1, 3, 2, 4, 5)
    blocks = [(0, 0), (0, n_sq - n), (0, 0), (0, 0)]
    o, lse = attend(q_sq.reshape(B, n_sq, G * d * h, d_k), jnp.pad(k_cmp[:, :n], blocks),
                    jnp.pad(v_cmp[:, :n], blocks), scale)

    def unfold(x):  # [B, n_sq, G * d * h, *rest] -> [B, rows, H, *rest]
        rest = x.shape[3:]
        x = x.reshape(B, n_sq, G, d, h, *rest)
        x = x.transpose(0, 1, 3, 2, 4, *range(5, 5 + len(rest)))
        return x.reshape(B, n_sq * d, H, *rest)[:, :rows]

    o = unfold(o)
    lse = lax.stop_gradient(unfold(lse.astype(jnp.promote_types(lse.dtype, jnp.float32))))
    o = jnp.pad(o, [(0, 0), (l - 1, 0), (0, 0), (0, 0)])
    lse = jnp.pad(lse, [(0, 0), (l - 1, 0), (0, 0)], constant_values=-jnp.inf)
    return o.astype(q.dtype), lse
