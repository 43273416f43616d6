"""Needle in a haystack at 64k and 128k tokens, kernel level, both frameworks.

Random q/k/v (paper sizes, bfloat16) with one planted selection block far from the end: its
keys (for one KV group) point along a direction u, and the last queries of that group's heads
point along u too, so the compressed attention, and through it the selection, favours the
planted block over the ~1,000 (64k) random ones. Its values are a distinctive vector. The
pipeline compress_kv -> compressed_attention (lse) -> select_blocks -> selected_attention must
select the planted block for those queries and return its value (o_sel), and the compressed
branch must carry it too (o_cmp). The block lies beyond the window and outside the forced
blocks, so only a working selection reaches it.

JAX runs through `nsa_jax.kernels` with backend ("pallas", "xla"); torch through
`nsa_torch_ref`'s kernel-level functions (Triton selected attention) on CUDA. The GPU cases are
marked `gpu` and skip without a GPU; the same checks at T = 2048 run on CPU in the normal suite.
"""
from __future__ import annotations

import dataclasses
import os

# JAX would otherwise reserve 75% of the GPU when it first starts, leaving the torch case short
# of memory at 64k (the runner sets this too).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import torch

from conftest import jax_has_gpu
from nsa_common import NSAConfig

# A planted score of ~12 against random ones of std ~0.7 (selection and compressed attention)
# leaves the planted tokens > 99% of the selected softmax: o_sel within a few % of the value.
PLANTED_LOGIT = 12.0
TOL_SEL = 0.05   # relative error of o_sel against the planted value (bf16 inputs)
MIN_COS_CMP = 0.9  # cosine of o_cmp and the planted value (the compressed blocks that straddle
                   # the planted block mix it with random tokens)
N_QUERIES = 4    # the last N_QUERIES tokens carry the needle query

PAPER = NSAConfig.paper(compress="mean")
SMALL = NSAConfig(d_model=64, n_heads=8, n_kv_heads=2, d_k=64, d_v=32, cmp_block=32,
                  cmp_stride=16, sel_block=64, n_sel=6, window=256, compress="mean")


@dataclasses.dataclass(frozen=True)
class Needle:
    """Where and what to plant: the selection block `block` of KV group `group`, for the query
    rows `rows` of the heads `heads`."""

    cfg: NSAConfig
    T: int
    group: int
    block: int
    rows: np.ndarray
    heads: slice
    direction: np.ndarray  # unit [d_k]
    value: np.ndarray  # [d_v]
    key_scale: float
    query_scale: float

    @property
    def tokens(self) -> slice:
        return slice(self.block * self.cfg.sel_block, (self.block + 1) * self.cfg.sel_block)


def make_needle(cfg: NSAConfig, T: int, seed: int = 0) -> Needle:
    rng = np.random.default_rng(seed)
    block = T // 4 // cfg.sel_block
    last_block = (T - 1) // cfg.sel_block
    # Not forced, and every planted token outside the query rows' window.
    assert cfg.n_init <= block < last_block - cfg.n_local + 1
    assert (block + 1) * cfg.sel_block <= T - N_QUERIES - cfg.window
    direction = rng.standard_normal(cfg.d_k)
    direction /= np.linalg.norm(direction)
    scale = float(np.sqrt(PLANTED_LOGIT * np.sqrt(cfg.d_k)))  # q.k * d_k**-0.5 = PLANTED_LOGIT
    group = cfg.n_kv_heads - 1
    h = cfg.heads_per_group
    return Needle(cfg=cfg, T=T, group=group, block=block, rows=np.arange(T - N_QUERIES, T),
                  heads=slice(group * h, (group + 1) * h), direction=direction,
                  value=3.0 * rng.choice([-1.0, 1.0], cfg.d_v), key_scale=scale,
                  query_scale=scale)


def check_outputs(needle: Needle, block_idx, o_cmp, o_sel) -> None:
    """block_idx `[T?, G, n_sel]`, o_* `[T?, H, d_v]` as numpy, rows already taken."""
    missing = [int(r) for r, idx in zip(needle.rows, block_idx[:, needle.group])
               if needle.block not in idx]
    assert not missing, (f"planted block {needle.block} not selected for query rows {missing}: "
                         f"{block_idx[:, needle.group].tolist()}")
    value = needle.value.astype(np.float64)
    sel = o_sel[:, needle.heads].astype(np.float64)
    err = np.linalg.norm(sel - value, axis=-1) / np.linalg.norm(value)
    assert err.max() < TOL_SEL, f"o_sel misses the planted value: relative errors {err}"
    cmp = o_cmp[:, needle.heads].astype(np.float64)
    cos = cmp @ value / (np.linalg.norm(cmp, axis=-1) * np.linalg.norm(value))
    assert cos.min() > MIN_COS_CMP, f"o_cmp does not point at the planted value: cosines {cos}"


# ---------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------
def run_jax(needle: Needle, dtype_name: str, backend) -> None:
    import jax
    import jax.numpy as jnp

    import nsa_jax

    cfg, T = needle.cfg, needle.T
    dtype = jnp.dtype(dtype_name)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(kq, (1, T, cfg.n_heads, cfg.d_k), dtype)
    k = jax.random.normal(kk, (1, T, cfg.n_kv_heads, cfg.d_k), dtype)
    v = jax.random.normal(kv, (1, T, cfg.n_kv_heads, cfg.d_v), dtype)
    u = jnp.asarray(needle.direction, dtype)
    q = q.at[0, needle.rows, needle.heads].set(needle.query_scale * u)
    k = k.at[0, needle.tokens, needle.group].set(needle.key_scale * u)
    v = v.at[0, needle.tokens, needle.group].set(jnp.asarray(needle.value, dtype))

    k_cmp = nsa_jax.compress_kv(k, None, cfg, backend=backend)
    v_cmp = nsa_jax.compress_kv(v, None, cfg, backend=backend)
    o_cmp, lse = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True,
                                              backend=backend)
    block_idx = nsa_jax.select_blocks(q, k_cmp, cfg, lse=lse, backend=backend)
    o_sel = nsa_jax.selected_attention(q, k, v, block_idx, cfg.sel_block, backend=backend)
    rows = needle.rows
    check_outputs(needle, np.asarray(block_idx[0, rows]),
                  np.asarray(o_cmp[0, rows].astype(jnp.float32)),
                  np.asarray(o_sel[0, rows].astype(jnp.float32)))


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------
def run_torch(needle: Needle, dtype: torch.dtype, device: str) -> None:
    from nsa_torch_ref import dispatch, reference

    cfg, T = needle.cfg, needle.T
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

    q = randn(1, T, cfg.n_heads, cfg.d_k)
    k = randn(1, T, cfg.n_kv_heads, cfg.d_k)
    v = randn(1, T, cfg.n_kv_heads, cfg.d_v)
    u = torch.as_tensor(needle.direction, device=device, dtype=dtype)
    rows = torch.as_tensor(needle.rows, device=device)
    q[0, rows, needle.heads] = needle.query_scale * u
    k[0, needle.tokens, needle.group] = needle.key_scale * u
    v[0, needle.tokens, needle.group] = torch.as_tensor(needle.value, device=device,
                                                        dtype=dtype)

    with torch.no_grad():
        k_cmp = reference.compress_kv(k, None, cfg)
        v_cmp = reference.compress_kv(v, None, cfg)
        o_cmp = reference.compressed_attention(q, k_cmp, v_cmp, cfg)
        block_idx = reference.select_blocks(q, k_cmp, cfg)
        selected = dispatch.resolve("selected_attention", "triton" if device == "cuda" else "sdpa")
        o_sel = selected(q, k, v, block_idx, cfg.sel_block)
    check_outputs(needle, block_idx[0, rows].cpu().numpy(), o_cmp[0, rows].float().cpu().numpy(),
                  o_sel[0, rows].float().cpu().numpy())


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def test_needle_jax_cpu():
    run_jax(make_needle(SMALL, 2048), "float32", "xla")


def test_needle_torch_cpu():
    run_torch(make_needle(SMALL, 2048), torch.float32, "cpu")


def test_needle_fails_without_the_plant():
    """The check is not vacuous: the same random inputs without the needle fail it."""
    needle = make_needle(SMALL, 2048)
    unplanted = dataclasses.replace(needle, key_scale=0.0, query_scale=0.0)
    with pytest.raises(AssertionError):
        run_jax(unplanted, "float32", "xla")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_needle_torch_gpu():
    run_torch(make_needle(PAPER, 65536), torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU visible to JAX")
@pytest.mark.parametrize("T", [65536, 131072], ids=["64k", "128k"])
def test_needle_jax_gpu(T):
    run_jax(make_needle(PAPER, T), "bfloat16", ("pallas", "xla"))
