"""When n_sel covers every selection block of the sequence (a short sequence, or the alignment
recipe's dense warm-up), the selected branch is causal attention and runs on the window
branch's path with w = T instead of gathering blocks, and block_idx is every eligible block,
without running the selection: the same output, gradients and block_idx as the gathered branch
and the float64 brute force, packed sequences included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from bruteforce import bf_nsa_layer
from jax_inputs import make_inputs
from nsa_common import NSAConfig
from nsa_jax import core, dispatch, layer


def branches_run(monkeypatch, params, x, cfg):
    """The dispatch branches the layer runs on x, in order (traced afresh, without jit's cache)."""
    seen, call = [], dispatch.call

    def counting(branch, *args, **kwargs):
        seen.append(branch)
        return call(branch, *args, **kwargs)

    monkeypatch.setattr(dispatch, "call", counting)
    layer.forward_unchecked(params, x, None, cfg=cfg, backend=dispatch.static_backend("xla"),
                            options=None)
    return seen


def test_selects_every_block_when_n_sel_covers_the_sequence():
    cfg = NSAConfig.tiny()  # l_sel 16, n_sel 4
    blocks = -(-np.arange(1, 200) // cfg.sel_block)
    for T, n in zip(range(1, 200), blocks):
        assert core.selects_every_block(cfg, T) == (n <= cfg.n_sel)
    assert core.selects_every_block(nsa_jax.dense_warmup_config(cfg, 1000), 1000)


@pytest.mark.parametrize("T", [23, 64])
def test_the_selected_branch_takes_the_window_path_and_matches_the_brute_force(x64, monkeypatch,
                                                                             T):
    cfg = nsa_jax.dense_warmup_config(NSAConfig.tiny(), T)
    params, x = make_inputs(cfg, 2, T, jnp.float64, seed=3)
    seen = branches_run(monkeypatch, params, x, cfg)
    assert "selected_attention" not in seen
    assert seen.count("sliding_window_attention") == 2  # the selected branch and the window
    y, aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    y_bf, aux_bf = bf_nsa_layer(params, x, cfg)
    np.testing.assert_allclose(np.asarray(y), y_bf, rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(aux["o_sel"]), aux_bf["o_sel"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("T,cu", [(23, None), (64, None), (48, [0, 17, 48]),
                                  (50, [0, 0, 5, 31, 50])])
def test_block_idx_is_the_selections_without_running_it(x64, monkeypatch, T, cu):
    """The shortcut's block_idx (every eligible block, no scores) is the float64 brute force's
    selection, packed sequences (an empty one included) too; the selection does not run."""
    cfg = nsa_jax.dense_warmup_config(NSAConfig.tiny(), T)
    B = 2 if cu is None else 1
    params, x = make_inputs(cfg, B, T, jnp.float64, seed=11)
    _, aux = nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu, return_aux=True)
    _, aux_bf = bf_nsa_layer(params, x, cfg, cu_seqlens=cu)
    assert aux["block_idx"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(aux["block_idx"]), aux_bf["block_idx"])
    if cu is None:
        assert "select_blocks" not in branches_run(monkeypatch, params, x, cfg)


def test_output_and_gradients_equal_the_gathered_branch(x64):
    T = 40
    cfg = nsa_jax.dense_warmup_config(NSAConfig.tiny(), T)
    params, x = make_inputs(cfg, 2, T, jnp.float64, seed=5)
    _, aux = nsa_jax.nsa_attention(params, x, cfg, return_aux=True)
    block_idx = aux["block_idx"]  # given explicitly, the branch gathers these blocks

    def loss(p, x, idx):
        y = nsa_jax.nsa_attention(p, x, cfg, block_idx=idx)
        return jnp.sum(jnp.sin(y))

    fast = jax.grad(lambda p, x: loss(p, x, None), argnums=(0, 1))(params, x)
    gathered = jax.grad(lambda p, x: loss(p, x, block_idx), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(fast), jax.tree_util.tree_leaves(gathered)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-10)


def test_packed_sequences_keep_to_their_own_tokens(x64):
    T, cu = 48, [0, 17, 48]
    cfg = nsa_jax.dense_warmup_config(NSAConfig.tiny(), T)
    params, x = make_inputs(cfg, 1, T, jnp.float64, seed=7)
    y = nsa_jax.nsa_attention(params, x, cfg, cu_seqlens=cu)
    y_bf, _ = bf_nsa_layer(params, x, cfg, cu_seqlens=cu)
    np.testing.assert_allclose(np.asarray(y), y_bf, rtol=0, atol=1e-10)


def test_a_sequence_longer_than_the_selection_still_gathers(monkeypatch):
    cfg = NSAConfig.tiny()
    T = cfg.sel_block * cfg.n_sel + 1
    params, x = make_inputs(cfg, 1, T, jnp.float32)
    seen = branches_run(monkeypatch, params, x, cfg)
    assert "selected_attention" in seen


def test_a_callers_own_selection_turns_the_shortcut_off(monkeypatch):
    """A selection backend registered from outside the library (here one that drops block 0)
    must run, and the selected branch must attend to what it chose."""
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    assert dispatch.library_only("select_blocks", "xla")
    assert dispatch.library_only("selected_attention", ("pallas", "xla"))

    def drop_first_block(q, k_cmp, cfg, *, scale, lse=None):
        idx = dispatch.xla.select_blocks(q, k_cmp, cfg, scale=scale)
        return jnp.where(idx == 0, -1, idx)

    nsa_jax.register_backend("select_blocks", "drop-first", drop_first_block)
    backend = ("drop-first", "xla")
    assert not dispatch.library_only("select_blocks", backend)
    cfg = NSAConfig.tiny()
    T = 40  # 3 blocks, n_sel 4: the library's own selection would take every block
    params, x = make_inputs(cfg, 1, T, jnp.float32, seed=2)
    _, aux = nsa_jax.nsa_attention(params, x, cfg, backend=backend, return_aux=True)
    _, gathered = nsa_jax.nsa_attention(params, x, cfg, block_idx=aux["block_idx"],
                                        return_aux=True)
    assert (np.asarray(aux["block_idx"]) != 0).all()
    np.testing.assert_allclose(np.asarray(aux["o_sel"]), np.asarray(gathered["o_sel"]),
                               rtol=1e-6, atol=1e-6)
