"""The shared test helpers (`nsa_common.testing`) against values worked out by hand."""
import math

import numpy as np
import pytest

from nsa_common.testing import random_block_idx, rel_err

REF = [3.0, 4.0]        # norm 5
OUT = [3.6, 4.8]        # OUT - REF = [0.6, 0.8], norm 1: relative error 1 / 5


def test_rel_err_numpy_and_lists():
    assert rel_err(np.asarray(OUT), np.asarray(REF)) == pytest.approx(0.2, rel=1e-12)
    assert rel_err(OUT, REF) == pytest.approx(0.2, rel=1e-12)
    assert rel_err(REF, REF) == 0.0
    assert isinstance(rel_err(OUT, REF), float)


def test_rel_err_torch_and_jax_give_the_same_value():
    torch = pytest.importorskip("torch")
    out = torch.tensor(OUT, requires_grad=True)  # needs detach
    assert rel_err(out, torch.tensor(REF, dtype=torch.float64)) == pytest.approx(0.2, rel=1e-6)
    # bfloat16 is read exactly: 1.5 against 1.0 is 0.5
    assert rel_err(torch.tensor([1.5], dtype=torch.bfloat16), np.ones(1)) == 0.5
    jnp = pytest.importorskip("jax.numpy")
    assert rel_err(jnp.asarray([1.5], jnp.bfloat16), jnp.ones(1)) == 0.5


def test_rel_err_zero_reference():
    out, zero = [0.0, 1e-3], [0.0, 0.0]
    assert rel_err(out, zero) == pytest.approx(1e27)
    assert rel_err(out, zero, absolute_if_zero=True) == pytest.approx(1e-3)
    assert rel_err(zero, zero) == 0.0
    # a non-zero reference is unaffected by absolute_if_zero
    assert rel_err(OUT, REF, absolute_if_zero=True) == pytest.approx(0.2)


def test_rel_err_nonfinite_output():
    bad = [math.nan, 4.0]
    with pytest.raises(AssertionError, match="NaN or Inf"):
        rel_err(bad, REF)
    assert math.isnan(rel_err(bad, REF, nonfinite="nan"))
    assert rel_err([math.inf, 0.0], REF, nonfinite="inf") == math.inf
    with pytest.raises(ValueError, match="nonfinite"):
        rel_err(OUT, REF, nonfinite="zero")


def test_random_block_idx_forced_blocks_by_hand():
    # block_size 2, n_sel 2, the first and the last eligible block forced: nothing is random.
    idx = random_block_idx(0, 1, 5, 1, 2, 2, n_init=1, n_local=1, fill=True)
    assert idx.dtype == np.int32 and idx.shape == (1, 5, 1, 2)
    np.testing.assert_array_equal(idx[0, :, 0], [[0, -1], [0, -1], [0, 1], [0, 1], [0, 2]])


def test_random_block_idx_packed_sequences_by_hand():
    # starts: t = 3, 4 begin again at block 0 (local positions 0, 1).
    idx = random_block_idx(0, 1, 5, 1, 2, 2, n_init=1, n_local=1, fill=True,
                           starts=[0, 0, 0, 3, 3])
    np.testing.assert_array_equal(idx[0, :, 0], [[0, -1], [0, -1], [0, 1], [0, -1], [0, -1]])


@pytest.mark.parametrize("fill", [True, False])
def test_random_block_idx_is_valid(fill):
    n_sel, l_sel, n_init, n_local = 5, 16, 1, 2
    B, T, G = 2, 100, 2
    idx = random_block_idx(np.random.default_rng(0), B, T, G, n_sel, l_sel, n_init=n_init,
                           n_local=n_local, fill=fill, query_chunk=32)
    assert idx.shape == (B, T, G, n_sel) and idx.dtype == np.int32
    counts = set()
    for t in range(T):
        last = t // l_sel
        eligible = last + 1
        forced = {j for j in range(n_init)} | {j for j in range(last - n_local + 1, last + 1)}
        forced = {j for j in forced if 0 <= j <= last}
        for b in range(B):
            for g in range(G):
                row = idx[b, t, g].tolist()
                chosen = [j for j in row if j >= 0]
                counts.add(len(chosen))
                if fill:
                    assert len(chosen) == min(n_sel, eligible)
                else:
                    assert max(len(forced), 1) <= len(chosen) <= min(n_sel, eligible)
                assert row == chosen + [-1] * (n_sel - len(chosen))
                assert chosen == sorted(set(chosen)) and chosen[-1] <= last
                assert forced <= set(chosen)
    assert len(counts) > (2 if not fill else 1)  # short and full rows both occur


def test_random_block_idx_seeded_and_checked():
    np.testing.assert_array_equal(random_block_idx(3, 1, 40, 2, 3, 4),
                                  random_block_idx(np.random.default_rng(3), 1, 40, 2, 3, 4))
    with pytest.raises(ValueError, match=r"n_sel \(2\) must be >= n_init \+ n_local \(3\)"):
        random_block_idx(0, 1, 8, 1, 2, 4, n_init=1, n_local=2)
