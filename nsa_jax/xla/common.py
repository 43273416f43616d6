"""Pieces shared by the XLA branches and by decode: softmax with empty rows, query chunking,
the precision policy."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

# None: JAX's default for the dtype, or the enclosing `jax.default_matmul_precision`, which the
# layer and core enter for their `precision=` argument (float32 on GPUs defaults to TF32, which
# the spec's 1e-5 float32 tolerance needs "highest" to avoid).
PRECISION = None


def compute_dtype(*dtypes) -> jnp.dtype:
    """Scores and softmax run in float32, or float64 when an input already is float64."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def einsum(spec: str, a, b, dtype):
    """`jnp.einsum` accumulating in `dtype` at `PRECISION` (inputs keep their own dtype)."""
    return jnp.einsum(spec, a, b, preferred_element_type=dtype, precision=PRECISION)


def masked_softmax(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis restricted to `mask`, with the running-max shift.

    scores: `[..., K]` float; mask: bool, broadcastable to `scores`.
    Returns `(p [..., K], lse [...])`. A row with no allowed key gets `p = 0` and `lse = -inf`.
    Both `where`s guard the masked entries on the way in and out, so that such rows (and the
    masked entries of every row) give finite, zero gradients instead of `0 * inf = NaN`.
    """
    mask = jnp.broadcast_to(mask, scores.shape)
    row_max = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True,
                      initial=-jnp.inf)
    # The shift cancels out of p and lse, so it carries no gradient.
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    exp = jnp.where(mask, jnp.exp(jnp.where(mask, scores, row_max) - row_max), 0.0)
    denom = jnp.sum(exp, axis=-1, keepdims=True)
    nonempty = denom > 0
    safe_denom = jnp.where(nonempty, denom, 1.0)
    p = exp / safe_denom
    lse = jnp.where(nonempty, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]
    return p, lse


def block_logsumexp(scores: jax.Array, valid: jax.Array, n_blocks: int) -> jax.Array:
    """scores `[..., n_blocks * l]`, valid (bool, broadcastable) -> the log-sum-exp over each
    block's valid entries `[..., n_blocks]` (-inf for a block without any)."""
    shape = scores.shape[:-1] + (n_blocks, scores.shape[-1] // n_blocks)
    valid = jnp.broadcast_to(valid, scores.shape).reshape(shape)
    return masked_softmax(scores.reshape(shape), valid)[1]


def map_query_chunks(body: Callable, chunk: int, *per_query: jax.Array):
    """Run `body(chunk_start, *chunks)` over query chunks and stitch the results back together.

    per_query: arrays `[B, T, ...]` aligned on the query axis (axis 1).
    body: `(chunk_start int32 scalar, *arrays [B, Q, ...]) -> pytree of [B, Q, ...]`.
    Returns the pytree with leaves `[B, T, ...]`.

    The last chunk is padded by repeating the last query (so padded rows are ordinary, finite
    rows) and the padding is cut off again. The body is rematerialised in the backward pass:
    without it the scan would keep every chunk's gathered keys alive at once.
    """
    T = per_query[0].shape[1]
    if T <= chunk:
        return body(jnp.int32(0), *per_query)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode="edge")
        return jnp.moveaxis(a.reshape(a.shape[0], n_chunks, chunk, *a.shape[2:]), 1, 0)

    def merge(a):
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape(a.shape[0], n_chunks * chunk, *a.shape[3:])[:, :T]

    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    remat_body = jax.checkpoint(body)
    out = lax.map(lambda args: remat_body(*args), (starts, *map(split, per_query)))
    return jax.tree_util.tree_map(merge, out)


def split_heads(q: jax.Array, n_groups: int) -> jax.Array:
    """`[B, T, H, D] -> [B, T, G, h, D]`: query head i belongs to group i // h."""
    B, T, H, D = q.shape
    return q.reshape(B, T, n_groups, H // n_groups, D)


def merge_heads(o: jax.Array) -> jax.Array:
    """`[B, T, G, h, D] -> [B, T, H, D]`."""
    B, T, G, h, D = o.shape
    return o.reshape(B, T, G * h, D)
