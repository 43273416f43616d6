"""Property test: over random configurations and lengths, `select_blocks` of both frameworks
equals the float64 brute force exactly (random scores have no ties, and rows without any
compressed block tie everywhere, which the rule "lower index first" decides)."""
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nsa_jax
import nsa_torch_ref
from bruteforce import bf_select_blocks
from conftest import enable_x64
from nsa_common import NSAConfig, num_cmp_blocks


@st.composite
def configs(draw):
    d = draw(st.sampled_from([2, 4]))
    l = d * draw(st.sampled_from([1, 2]))
    l_sel = l * draw(st.sampled_from([1, 2]))
    n_init = draw(st.integers(0, 1))
    n_local = draw(st.integers(0, 2))
    n_sel = draw(st.integers(max(1, n_init + n_local), 6))
    G = draw(st.sampled_from([1, 2]))
    h = draw(st.sampled_from([1, 2, 4]))
    cfg = NSAConfig(d_model=8, n_heads=G * h, n_kv_heads=G, d_k=8, d_v=8, cmp_block=l,
                    cmp_stride=d, sel_block=l_sel, n_sel=n_sel, n_init=n_init, n_local=n_local,
                    window=8)
    return cfg, draw(st.integers(1, 48)), draw(st.integers(0, 2 ** 16))


@settings(max_examples=12, deadline=None)
@given(configs())
def test_select_blocks_agrees_with_brute_force(case):
    cfg, T, seed = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, cfg.n_heads, cfg.d_k))
    k_cmp = rng.standard_normal((2, num_cmp_blocks(cfg, T), cfg.n_kv_heads, cfg.d_k))
    expected = bf_select_blocks(q, k_cmp, cfg)
    got_torch = nsa_torch_ref.select_blocks(torch.from_numpy(q), torch.from_numpy(k_cmp), cfg)
    np.testing.assert_array_equal(got_torch.numpy(), expected)
    with enable_x64():
        got_jax = nsa_jax.select_blocks(jnp.asarray(q), jnp.asarray(k_cmp), cfg)
    np.testing.assert_array_equal(np.asarray(got_jax), expected)
    # The rules themselves, independently of any implementation.
    for t in range(T):
        row = expected[0, t, 0]
        chosen = row[row >= 0]
        assert np.all(np.diff(chosen) > 0) and np.all(row[len(chosen):] == -1)
        assert chosen.max() <= t // cfg.sel_block
        last = t // cfg.sel_block
        forced = (set(range(min(cfg.n_init, last + 1)))
                  | set(range(max(0, last - cfg.n_local + 1), last + 1)))
        assert forced <= set(chosen.tolist())
        assert len(chosen) == min(cfg.n_sel, last + 1)
