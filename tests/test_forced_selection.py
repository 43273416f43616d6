"""A given `block_idx` (the parity report's shared selection) in both frameworks: equal to the
layer's own selection it changes nothing; a different one changes only the selected branch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import nsa_jax
import nsa_torch_ref
from nsa_common import NSAConfig
from parity.convert import module_to_params
from tests.conftest import enable_x64

CFG = NSAConfig.tiny()
T = 96


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    module = nsa_torch_ref.NSAAttention(CFG).double()
    x = torch.randn(2, T + 3, CFG.d_model, dtype=torch.float64)
    return module, x


def _shifted(block_idx: np.ndarray) -> np.ndarray:
    """The last query's selection with one block swapped for an eligible one it left out (a
    different, still causal selection)."""
    out = block_idx.copy()
    row = out[1, -1, 0]
    free = [j for j in range((T - 1) // CFG.sel_block + 1) if j not in row]
    row[1] = free[0]
    out[1, -1, 0] = np.sort(row)
    return out


def test_jax_layer_given_own_selection_is_unchanged(layer):
    module, x = layer
    with enable_x64():
        params = module_to_params(module, jax.devices("cpu")[0])
        xj = jnp.asarray(x[:, :T].numpy())
        y, aux = nsa_jax.nsa_attention(params, xj, CFG, return_aux=True)
        y_forced, aux_forced = nsa_jax.nsa_attention(params, xj, CFG, return_aux=True,
                                                     block_idx=aux["block_idx"])
        # The same blocks give the same output; the forced call is another program (no
        # selection stage), which XLA may fuse differently: equal to float64 rounding.
        np.testing.assert_allclose(np.asarray(y_forced), np.asarray(y), rtol=1e-12, atol=1e-14)
        other = _shifted(np.asarray(aux["block_idx"]))
        assert (other != np.asarray(aux["block_idx"])).any()
        y_other, aux_other = nsa_jax.nsa_attention(params, xj, CFG, return_aux=True,
                                                   block_idx=jnp.asarray(other))
        np.testing.assert_array_equal(np.asarray(aux_other["block_idx"]), other)
        np.testing.assert_array_equal(np.asarray(aux_other["o_win"]), np.asarray(aux["o_win"]))
        assert not np.allclose(np.asarray(aux_other["o_sel"]), np.asarray(aux["o_sel"]))


def test_torch_layer_given_selection_matches_jax(layer):
    module, x = layer
    with torch.no_grad():
        y, aux = module(x[:, :T], return_aux=True)
        y_forced = module(x[:, :T], block_idx=aux["block_idx"])
        torch.testing.assert_close(y_forced, y, rtol=0, atol=0)
        other = torch.from_numpy(_shifted(aux["block_idx"].numpy()))
        y_other, aux_other = module(x[:, :T], return_aux=True, block_idx=other)
    with enable_x64():
        params = module_to_params(module, jax.devices("cpu")[0])
        yj, auxj = nsa_jax.nsa_attention(params, jnp.asarray(x[:, :T].numpy()), CFG,
                                         return_aux=True, block_idx=jnp.asarray(other.numpy()))
    np.testing.assert_allclose(np.asarray(auxj["o_sel"]), aux_other["o_sel"].numpy(), atol=1e-12)
    np.testing.assert_allclose(np.asarray(yj), y_other.numpy(), atol=1e-12)


def test_decode_given_own_selection_is_unchanged(layer):
    module, x = layer
    with enable_x64():
        params = module_to_params(module, jax.devices("cpu")[0])
        xj = jnp.asarray(x.numpy())
        outs = []
        for forced in (False, True):
            cache = nsa_jax.init_cache(CFG, 2, T + 3, jnp.float64)
            _, cache, aux = nsa_jax.prefill(params, xj[:, :T], CFG, cache, return_aux=True)
            ys = []
            for i in range(3):
                y, cache_next, _, aux = nsa_jax.decode_step(params, xj[:, T + i:T + i + 1], CFG,
                                                            cache, return_aux=True)
                if forced:
                    y, cache_next, _, _ = nsa_jax.decode_step(
                        params, xj[:, T + i:T + i + 1], CFG, cache, block_idx=aux["block_idx"],
                        return_aux=True)
                cache = cache_next
                ys.append(np.asarray(y))
            outs.append(np.concatenate(ys, 1))
        np.testing.assert_array_equal(outs[1], outs[0])
    cache = nsa_torch_ref.init_cache(CFG, 2, T + 3, torch.float64)
    _, cache = nsa_torch_ref.prefill(module, x[:, :T], cache)
    y, _, _, aux = nsa_torch_ref.decode_step(module, x[:, T:T + 1], cache, return_aux=True)
    cache = nsa_torch_ref.init_cache(CFG, 2, T + 3, torch.float64)
    _, cache = nsa_torch_ref.prefill(module, x[:, :T], cache)
    y_forced, _, _ = nsa_torch_ref.decode_step(module, x[:, T:T + 1], cache,
                                               block_idx=aux["block_idx"])
    torch.testing.assert_close(y_forced, y, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, T, 2), (2, T, CFG.n_kv_heads, CFG.n_sel + 1)])
def test_bad_block_idx_names_the_argument(layer, shape):
    module, x = layer
    params = module_to_params(module.float(), jax.devices("cpu")[0])
    module.double()
    with pytest.raises(ValueError, match="block_idx"):
        nsa_jax.nsa_attention(params, jnp.asarray(x[:, :T].float().numpy()), CFG,
                              block_idx=jnp.zeros(shape, jnp.int32))
    with pytest.raises(ValueError, match="block_idx"):
        module(x[:, :T], block_idx=torch.zeros(shape, dtype=torch.int32))
