"""Stand-ins of flash_attn3_jax's forward and backward primitives, so that the FA-3 paths
(`nsa_jax.xla.cudnn`) run exactly on a CPU: patch `cudnn._fa3_ops` to return them.

They compute in NumPy float64 behind `jax.pure_callback`, so they look to JAX as the real ones
do: opaque calls whose outputs vary over no mesh axis inside a `shard_map` (an FFI call's
abstract evaluation drops the manual-axis types of its operands), and with no derivative of
their own. Layout as flash_attn3_jax's: q `[B, S, N, D]`, k and v `[B, S, G, D]` (GQA), lse
`[B, N, S]`, a `(left, right)` window with left -1 unbounded.

Arrays cross to the host as their bytes: XLA runs the callback on a worker thread, where a
test's `jax.enable_x64` context does not reach and float64 arguments would arrive as float32.
"""
import jax
import numpy as np
from jax import lax


def _probs(q, k, softmax_scale, window_size):
    """Softmax probabilities `[B, N, S, S]` (keys repeated per query head) and lse `[B, N, S]`."""
    S = q.shape[1]
    s = np.einsum("bqnd,bknd->bnqk", q, k) * softmax_scale
    i, j = np.arange(S)[:, None], np.arange(S)[None]
    allowed = (j <= i) & ((window_size[0] < 0) | (j >= i - window_size[0]))
    s = np.where(allowed, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)          # the diagonal is always allowed: finite
    lse = np.log(np.exp(s - top).sum(axis=-1)) + top[..., 0]
    return np.exp(s - lse[..., None]), lse


def _repeat(x, group):
    return np.repeat(np.asarray(x, np.float64), group, axis=2)


def _forward(q, k, v, softmax_scale, window_size):
    group = q.shape[2] // k.shape[2]
    p, lse = _probs(np.asarray(q, np.float64), _repeat(k, group), softmax_scale, window_size)
    return np.einsum("bnqk,bknd->bqnd", p, _repeat(v, group)), lse


def _backward(do, q, k, v, softmax_scale, window_size):
    B, S, N, D = q.shape
    G = k.shape[2]
    q, do = np.asarray(q, np.float64), np.asarray(do, np.float64)
    k_rep, v_rep = _repeat(k, N // G), _repeat(v, N // G)
    p, _ = _probs(q, k_rep, softmax_scale, window_size)
    o = np.einsum("bnqk,bknd->bqnd", p, v_rep)
    dv = np.einsum("bnqk,bqnd->bknd", p, do)
    dp = np.einsum("bqnd,bknd->bnqk", do, v_rep)
    delta = np.einsum("bqnd,bqnd->bnq", do, o)
    ds = p * (dp - delta[..., None]) * softmax_scale
    dq = np.einsum("bnqk,bknd->bqnd", ds, k_rep)
    dk = np.einsum("bnqk,bqnd->bknd", ds, q)

    def per_kv_head(x):
        return x.reshape(B, S, G, N // G, x.shape[-1]).sum(axis=3)

    return dq, per_kv_head(dk), per_kv_head(dv)


def _host_call(fn, out_avals, *args):
    """`fn(*numpy arrays) -> tuple of arrays` as a `pure_callback` whose operands and results
    travel as bytes (uint8), so no dtype is canonicalised on the way."""
    def to_bytes(x):
        return lax.bitcast_convert_type(x, np.uint8)

    def host(*raw):
        values = [np.asarray(r).view(a.dtype).reshape(a.shape) for r, a in zip(raw, args)]
        return tuple(np.ascontiguousarray(np.asarray(out, np.float64).astype(aval.dtype))
                     .view(np.uint8).reshape(aval.shape + (aval.dtype.itemsize,))
                     for out, aval in zip(fn(*values), out_avals))

    raw_avals = tuple(jax.ShapeDtypeStruct(a.shape + (a.dtype.itemsize,), np.uint8)
                      for a in out_avals)
    raw = jax.pure_callback(host, raw_avals, *map(to_bytes, args))
    return tuple(lax.bitcast_convert_type(r, a.dtype) for r, a in zip(raw, out_avals))


def fa3_forward_f64(q, k, v, softmax_scale, is_causal, window_size):
    """(o `[B, S, N, d_v]`, lse `[B, N, S]`), causal, keys `i - left .. i` (GQA)."""
    assert is_causal and window_size[1] in (0, -1)
    shapes = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype),
              jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), q.dtype))
    return _host_call(lambda q, k, v: _forward(q, k, v, softmax_scale, window_size), shapes,
                      q, k, v)


def fa3_backward_f64(do, q, k, v, out, lse, softmax_scale, is_causal, window_size):
    """(dq, dk, dv) of `fa3_forward_f64`'s o against the cotangent do."""
    assert is_causal and window_size[1] in (0, -1)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return _host_call(lambda do, q, k, v: _backward(do, q, k, v, softmax_scale, window_size),
                      shapes, do, q, k, v)


def open_fa3_paths(monkeypatch) -> list:
    """Patch `nsa_jax.xla.cudnn` so that on a CPU the fused paths take the arrays (cuDNN's gate
    open, a Hopper's head-size limit) and FA-3 runs on these stand-ins. Returns the list into
    which each FA-3 forward call appends its `window_size` (which branches took FA-3)."""
    from nsa_jax.xla import cudnn

    taken = []

    def forward(q, k, v, **kw):
        taken.append(kw["window_size"])
        return fa3_forward_f64(q, k, v, **kw)

    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: (forward, fa3_backward_f64))
    monkeypatch.setattr(cudnn, "takes", lambda q, k, v: True)
    monkeypatch.setattr(cudnn, "max_head_dim", lambda: 256)
    return taken
