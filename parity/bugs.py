"""Bugs planted in the JAX layer on purpose, so that the parity report can show it sees them
(`python -m parity --plant NAME` must FAIL; tests/test_parity_planted.py checks every one in
float32 and bfloat16). Each is a mistake an NSA port could plausibly make.

`planted(name)` patches the layer's composition for the duration of a `with` block and clears
JAX's compilation caches on entry and exit, so no compiled function outlives the patch.
"""
from __future__ import annotations

import contextlib

BUGS = {
    "window_off_by_one": "the window branch admits w + 1 tokens (its causal edge off by one)",
    "forced_block": "the selection no longer forces the newest-but-one block (n_local - 1)",
    "cmp_stride": "compressed block i summarises the tokens of block 2i (stride 2d, not d)",
    "dropped_gate": "the selected branch's output is added without its gate",
    "missing_scale": "the selected branch's scores lack the 1/sqrt(d_k) scale",
    "worse_blocks": "the selection takes the lowest-scoring free blocks, not the highest",
}


def _patched_call(name: str, call):
    import jax.numpy as jnp

    def run(branch, backend, *args, **kwargs):
        if name == "window_off_by_one" and branch == "sliding_window_attention":
            kwargs["window"] = kwargs["window"] + 1
        elif name == "missing_scale" and branch == "selected_attention":
            kwargs["scale"] = 1.0
        elif name == "forced_block" and branch == "select_blocks":
            q, k_cmp, cfg = args
            args = (q, k_cmp, cfg.replace(n_local=cfg.n_local - 1))
        elif name == "worse_blocks" and branch == "select_blocks":
            q, k_cmp, cfg = args
            # Negated queries rank the compressed blocks in reverse; forced blocks stay forced.
            args, kwargs = (-q, k_cmp, cfg), dict(kwargs, lse=None)
        out = call(branch, backend, *args, **kwargs)
        if name == "cmp_stride" and branch == "compress_kv":
            n = out.shape[1]
            out = out[:, jnp.minimum(2 * jnp.arange(n), n - 1)]
        return out
    return run


def _without_gate(gates, o_cmp, o_sel, o_win):
    return gates[..., 0:1] * o_cmp + o_sel + gates[..., 2:3] * o_win


@contextlib.contextmanager
def planted(name: str):
    """Plant bug `name` (a key of BUGS) in the JAX layer for the duration."""
    if name not in BUGS:
        raise ValueError(f"plant ({name!r}) must be one of {sorted(BUGS)}")
    import jax  # here, so that `python -m parity --help` stays instant

    from nsa_jax import core, dispatch
    saved_call, saved_mix = dispatch.call, core.mix_branches
    jax.clear_caches()
    try:
        dispatch.call = _patched_call(name, saved_call)
        if name == "dropped_gate":
            core.mix_branches = _without_gate
        yield
    finally:
        dispatch.call, core.mix_branches = saved_call, saved_mix
        jax.clear_caches()

