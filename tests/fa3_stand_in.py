"""Float64 stand-ins of flash_attn3_jax's forward and backward primitives, so that the FA-3 paths
(`nsa_jax.xla.cudnn`) run exactly on a CPU: patch `cudnn._fa3_ops` to return them."""
import jax
import jax.numpy as jnp
import numpy as np


def fa3_forward_f64(q, k, v, softmax_scale, is_causal, window_size):
    """Stand-in of flash_attn3_jax's forward primitive: (o, lse `[B, N, S]`), causal, keys
    `i - left .. i` when `window_size = (left, 0)` (left -1: unbounded), GQA."""
    assert is_causal and window_size[1] in (0, -1)
    S, N = q.shape[1], q.shape[2]
    group = N // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) * softmax_scale
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    allowed = (j <= i) & ((window_size[0] < 0) | (j >= i - window_size[0]))
    s = jnp.where(allowed, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", jnp.exp(s - lse[..., None]), v), lse


def fa3_backward_f64(do, q, k, v, out, lse, softmax_scale, is_causal, window_size):
    _, pullback = jax.vjp(lambda q, k, v: fa3_forward_f64(q, k, v, softmax_scale, is_causal,
                                                          window_size)[0], q, k, v)
    return pullback(do)
