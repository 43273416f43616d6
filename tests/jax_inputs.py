"""Shared helpers of the nsa_jax tests: random layer inputs, the matmul precisions of a jaxpr
(the relative error is `nsa_common.testing.rel_err`)."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import nsa_jax

AUX_FLOAT = ("o_cmp", "o_sel", "o_win", "gates")


def make_inputs(cfg, B, T, dtype, seed=0):
    """Parameters (with non-zero gate biases, so their paths are exercised) and x [B, T, D]."""
    params = nsa_jax.init_params(jax.random.PRNGKey(seed), cfg, dtype)
    rng = np.random.default_rng(seed)
    params["bg"] = jnp.asarray(0.3 * rng.standard_normal(params["bg"].shape), dtype)
    x = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), dtype)
    return params, x


def dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += dot_precisions(sub)
    return found
