"""`NSAAttention`: the NSA layer as a Flax NNX module (needs the `flax` extra, flax >= 0.12).

A thin holder of the functional layer's parameters: `__call__` is `nsa_jax.nsa_attention`,
`alignment_loss` is `nsa_jax.selection_alignment_loss`, decode is `nsa_jax.init_cache` /
`prefill` / `decode_step` on a cache the module keeps, and `to_params` / `from_params` convert
to and from the pytree of DESIGN.md (so `parity`, checkpoints and the functional API see the
same weights). Parameters are attributes named by their pytree path joined with `_` (`wq`,
`wk_cmp`, `cmp_k_w1`, ...).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from nsa_common import NSAConfig
from nsa_jax import checks, core, decode, dispatch, layer
from nsa_jax.alignment import AlignmentOptions, dense_warmup_config, selection_alignment_loss

Initializer = Callable[[jax.Array, tuple, Any], jax.Array]


def fan_in_normal(key: jax.Array, shape: tuple, dtype=jnp.float32) -> jax.Array:
    """`normal(0, 1/sqrt(fan_in))` for `[..., in, out]` matrices (the layer's `init_params`)."""
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[-2])).astype(dtype)


def _param_paths(cfg: NSAConfig) -> list[tuple[tuple[str, ...], tuple]]:
    """`(path, shape)` of every leaf of `layer.param_shapes(cfg)`, in pytree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(layer.param_shapes(cfg),
                                                   is_leaf=lambda s: isinstance(s, tuple))
    return [(tuple(k.key for k in path), shape) for path, shape in flat]


DEFAULT_POS_INIT = nnx.initializers.normal(0.02)
DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


def _leaf(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _initializer(name: str, kernel_init, pos_init, bias_init) -> Initializer:
    return bias_init if name.startswith("b") else pos_init if name == "pos" else kernel_init


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "kernel_init", "pos_init",
                                             "bias_init"))
def _draw(key, *, cfg: NSAConfig, dtype, kernel_init, pos_init, bias_init) -> list:
    """Every parameter in `_param_paths` order, drawn in one compiled call (one per leaf,
    op by op, would compile a random kernel per shape)."""
    paths = _param_paths(cfg)
    keys = jax.random.split(key, len(paths))
    return [_initializer(path[-1], kernel_init, pos_init, bias_init)(k, shape, dtype)
            for k, (path, shape) in zip(keys, paths)]


class NSAAttention(nnx.Module):
    """Native Sparse Attention over x `[B, T, d_model]` -> `[B, T, d_model]`.

    cfg: the layer's `NSAConfig`.
    dtype: the computation dtype (x and the parameters are cast to it); None computes in the
        promotion of x's and the parameters' dtypes. The output has x's dtype, or `dtype`.
    param_dtype: the dtype the parameters are stored in.
    precision: of the matmuls (`nsa_attention`'s `precision`), also applied to decode.
    kernel_init: projections and compression-MLP matrices `[..., in, out]` (default
        `normal(0, 1/sqrt(in))`); pos_init: the compression MLPs' position embeddings (default
        `normal(0, 0.02)`); bias_init: the gate and compression-MLP biases (default zeros).
        With all three left None the parameters are `nsa_jax.init_params(rngs.params(), cfg,
        param_dtype)`, value for value.
    backend / options: of the forward and prefill (`nsa_attention`'s); decode_backend: of
        `decode_step` (the same forms: "xla", "pallas", a sequence of names).
    """

    def __init__(self, cfg: NSAConfig, *, dtype=None, param_dtype=jnp.float32,
                 precision: core.Precision = None,
                 kernel_init: Optional[Initializer] = None,
                 pos_init: Optional[Initializer] = None,
                 bias_init: Optional[Initializer] = None,
                 backend: dispatch.Backend = "xla",
                 decode_backend: dispatch.Backend = "xla",
                 options: Optional[Mapping[str, Any]] = None, rngs: nnx.Rngs):
        checks.config(cfg)
        self.cfg = cfg
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.precision = core.check_precision(precision)
        self.backend = dispatch.backend_names(backend)
        self.decode_backend = dispatch.backend_names(decode_backend)
        # Hashable items (static module data); `_options()` turns them back into a dict.
        self.options = dispatch.static_options(options)
        key, param_dtype = rngs.params(), jnp.dtype(param_dtype)
        if kernel_init is None and pos_init is None and bias_init is None:
            # init_params draws everything in one random kernel: far faster to compile.
            params = layer.init_params(key, cfg, param_dtype)
            values = [_leaf(params, path) for path, _ in _param_paths(cfg)]
        else:
            values = _draw(key, cfg=cfg, dtype=param_dtype,
                           kernel_init=kernel_init or fan_in_normal,
                           pos_init=pos_init or DEFAULT_POS_INIT,
                           bias_init=bias_init or DEFAULT_BIAS_INIT)
        for (path, _), value in zip(_param_paths(cfg), values):
            setattr(self, "_".join(path), nnx.Param(value))
        self.cache = nnx.data(None)  # a DecodeCache in an nnx.Cache after `init_cache`

    # -- the functional pytree ------------------------------------------------------------------
    def to_params(self) -> dict:
        """The parameters as the functional layer's pytree (`nsa_jax.init_params`' layout)."""
        params: dict = {}
        for path, _ in _param_paths(self.cfg):
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = getattr(self, "_".join(path))[...]
        return params

    def load_params(self, params: Mapping) -> None:
        """Replace every parameter by the matching leaf of `params` (shapes checked; the leaves
        keep their own dtypes)."""
        layer.check_params(params, self.cfg)
        for path, _ in _param_paths(self.cfg):
            getattr(self, "_".join(path)).set_value(jnp.asarray(_leaf(params, path)))

    @classmethod
    def from_params(cls, params: Mapping, cfg: NSAConfig, **kwargs) -> "NSAAttention":
        """A module holding `params` (the functional pytree); kwargs as for `__init__` (rngs
        not needed: nothing is drawn)."""
        kwargs.pop("rngs", None)
        module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **kwargs))
        module.load_params(params)
        return module

    def _options(self) -> Optional[dict]:
        return dict(self.options) if self.options else None

    def _cast(self, params: dict, x: jax.Array):
        if self.dtype is None:
            return params, x
        return jax.tree_util.tree_map(lambda a: a.astype(self.dtype), (params, x))

    # -- prefill / training ---------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, cu_seqlens=None, return_aux: bool = False,
                 dense_selection: bool = False):
        """`nsa_attention` with this module's parameters: x `[B, T, d_model]` -> y (and aux).

        dense_selection: the dense warm-up stage of selection alignment: every eligible block
        is selected (`nsa_jax.dense_warmup_config`), so the selected branch is full causal
        attention; the parameters are the same.
        """
        params, x = self._cast(self.to_params(), x)
        cfg = dense_warmup_config(self.cfg, x.shape[1]) if dense_selection else self.cfg
        return layer.nsa_attention(params, x, cfg, cu_seqlens=cu_seqlens,
                                   backend=self.backend, options=self._options(),
                                   precision=self.precision, return_aux=return_aux)

    def alignment_loss(self, x: jax.Array, *, cu_seqlens=None,
                       alignment: Optional[AlignmentOptions] = None,
                       block_idx: Optional[jax.Array] = None, return_aux: bool = False):
        """`nsa_jax.selection_alignment_loss` of this layer for its input x `[B, T, d_model]`:
        the KL between the selection's block importance and the layer's own attention, to add
        to the training loss (gradient to `wk_cmp` and `cmp_k_*` by default; `alignment`:
        `AlignmentOptions`). block_idx: the selection of the forward (`aux["block_idx"]`), for
        `mode="sparse"`."""
        params, x = self._cast(self.to_params(), x)
        return selection_alignment_loss(
            params, x, self.cfg, alignment=alignment, cu_seqlens=cu_seqlens, block_idx=block_idx,
            backend=self.backend, options=self._options(), precision=self.precision,
            return_aux=return_aux)

    # -- decode -----------------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=None) -> None:
        """Start decoding: an empty cache for `batch` sequences of up to `max_len` tokens, in
        `dtype` (default: the module's `dtype`, else the parameters')."""
        if dtype is None:
            dtype = self.dtype or self.wq[...].dtype
        self.cache = nnx.Cache(decode.init_cache(self.cfg, batch, max_len, dtype))

    def _decode_cache(self) -> decode.DecodeCache:
        if self.cache is None:
            raise ValueError("the module has no cache: call init_cache(batch, max_len) first")
        return self.cache.get_value()

    def prefill(self, x: jax.Array, *, return_aux: bool = False):
        """Run the prompt x `[B, T, d_model]` into the (fresh) cache -> y (and aux)."""
        params, x = self._cast(self.to_params(), x)
        with core.precision_scope(self.precision):
            out = decode.prefill(params, x, self.cfg, self._decode_cache(), backend=self.backend,
                                 options=self._options(), return_aux=return_aux)
        self.cache.set_value(out[1])
        return (out[0], out[2]) if return_aux else out[0]

    def decode_step(self, x_t: jax.Array, *, return_aux: bool = False):
        """Append one token per sequence x_t `[B, 1, d_model]` -> y_t, and with `return_aux`
        also `(reads, aux)` as `nsa_jax.decode_step` returns them."""
        params, x_t = self._cast(self.to_params(), x_t)
        with core.precision_scope(self.precision):
            out = decode.decode_step(params, x_t, self.cfg, self._decode_cache(),
                                     backend=self.decode_backend, options=self._options(),
                                     return_aux=return_aux)
        self.cache.set_value(out[1])
        return (out[0], *out[2:]) if return_aux else out[0]
