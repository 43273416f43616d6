"""Input validation at the public boundary: user errors are `ValueError`s naming the argument."""
from __future__ import annotations

import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from nsa_common import NSAConfig


def config(cfg) -> NSAConfig:
    if not isinstance(cfg, NSAConfig):
        raise ValueError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    return cfg


def array(name: str, x, rank: int, *, floating: bool = True, integer: bool = False):
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != rank:
        raise ValueError(f"{name} must be a rank-{rank} array, got shape {shape}")
    dtype = jnp.result_type(x)
    if floating and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got {dtype}")
    if integer and not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {dtype}")
    return x


def dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name} has {what} {actual}, expected {expected}")


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a positive int")
    return value


def scale(value, d_k: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(d_k)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"scale ({value!r}) must be a float or None") from None
    if not value > 0:
        raise ValueError(f"scale ({value}) must be positive")
    return value


def queries(name: str, q, *, n_kv_heads: Optional[int] = None):
    """q `[B, T, H, d_k]` with T >= 1 and, if given, H a multiple of `n_kv_heads`."""
    array(name, q, 4)
    if q.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one token (T = 0)")
    if n_kv_heads is not None and q.shape[2] % n_kv_heads:
        raise ValueError(f"{name} has {q.shape[2]} heads, not a multiple of the {n_kv_heads} "
                         f"KV heads")
    return q


def cmp_params(name: str, params: Optional[Mapping], cfg: NSAConfig, n_groups: int,
               dim_: int) -> None:
    """The `cmp_k` / `cmp_v` dict of DESIGN.md, or None exactly when compress == "mean"."""
    if cfg.compress == "mean":
        if params is not None:
            raise ValueError(f"{name} must be None with compress='mean'")
        return
    if not isinstance(params, Mapping):
        raise ValueError(f"{name} must be a dict of pos/w1/b1/w2/b2 with compress='mlp', "
                         f"got {type(params).__name__}")
    l = cfg.cmp_block
    expected = {"pos": (n_groups, l, dim_), "w1": (n_groups, l * dim_, dim_),
                "b1": (n_groups, dim_), "w2": (n_groups, dim_, dim_), "b2": (n_groups, dim_)}
    for key, shape in expected.items():
        if key not in params:
            raise ValueError(f"{name} lacks {key!r}")
        if tuple(params[key].shape) != shape:
            raise ValueError(f"{name}[{key!r}] has shape {tuple(params[key].shape)}, "
                             f"expected {shape}")


def cu_seqlens_valid(cu_seqlens, seq_len: int) -> jax.Array:
    """bool scalar: `cu_seqlens` `[N + 1]` rises from 0 to `seq_len` without a drop. Plain jnp,
    so it also works on traced values (e.g. to skip a batch with `lax.cond`)."""
    cu = jnp.asarray(cu_seqlens)
    return (cu[0] == 0) & (cu[-1] == seq_len) & jnp.all(cu[1:] >= cu[:-1])


def check_cu_seqlens(cu_seqlens, seq_len: int) -> None:
    """Check the values of `cu_seqlens` (int `[N + 1]`): `0 = cu[0] <= ... <= cu[N] = seq_len`.

    Concrete values: ValueError when they are wrong. Traced values (under `jax.jit`), which the
    layer cannot see: a `jax.experimental.checkify.check`, so the caller's function must be
    wrapped in `checkify.checkify` (the error then comes back from it; `err.throw()` raises):

        @jax.jit
        def step(params, x, cu):
            nsa_jax.check_cu_seqlens(cu, x.shape[1])
            return nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu)
        err, y = checkify.checkify(step)(params, x, cu)
        err.throw()

    Without `checkify` a traced call fails at trace time saying so: a wrong packing is otherwise
    silent (sequences overlap, or tokens fall outside every sequence).
    """
    array("cu_seqlens", cu_seqlens, 1, floating=False, integer=True)
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold at least 2 entries ([0, T] for one sequence)")
    values = concrete(cu_seqlens)
    if values is not None:
        if values[0] != 0 or values[-1] != seq_len or np.any(np.diff(values) < 0):
            raise ValueError(f"cu_seqlens ({values.tolist()}) must rise from 0 to T = {seq_len}")
        return
    cu = jnp.asarray(cu_seqlens)
    checkify.check(cu_seqlens_valid(cu, seq_len),
                   "cu_seqlens must rise from 0 to T = {T}: it starts at {first}, ends at "
                   "{last} and falls {drops} time(s)", T=jnp.int32(seq_len), first=cu[0],
                   last=cu[-1], drops=jnp.sum(cu[1:] < cu[:-1]))


def concrete(x):
    """x as a NumPy array, or None when it is traced (values cannot be checked under jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
