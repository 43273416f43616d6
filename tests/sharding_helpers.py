"""Helpers shared by the sharded-layer tests (fake CPU devices in `test_sharding_mesh.py`, GPUs in
`gpu/test_gpu_sharding.py`): a mesh named after the axes' roles, the loss and gradients of a
layer in one compiled call, and the relative error of every gradient leaf."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nsa_common.testing import rel_err
from nsa_jax import sharding


def make_mesh(**sizes) -> tuple[Mesh, sharding.MeshAxes]:
    """A mesh over the first prod(sizes) devices with axes named after their roles."""
    names = tuple(sizes)
    devices = np.array(jax.devices()[:int(np.prod(list(sizes.values())))])
    return (Mesh(devices.reshape(tuple(sizes.values())), names),
            sharding.MeshAxes(**{role: role if role in sizes else None
                                 for role in ("data", "model", "context")}))


def loss_and_grads(layer, params, x):
    """(y, aux, grads w.r.t. (params, x)) of `sum(sin(y))` in one compiled call; the loss is
    taken in at least float32 (a bf16 y is upcast, float64 stays float64)."""
    def loss(params, x):
        y, aux = layer(params, x)
        return jnp.sum(jnp.sin(y.astype(jnp.promote_types(y.dtype, jnp.float32)))), (y, aux)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return y, aux, grads


def grad_errors(grads, ref_grads) -> dict[str, float]:
    """Relative error of every gradient leaf, by name. `cmp_k.b2`'s gradient is analytically zero
    (docs/DESIGN.md), so its largest magnitude is measured against the RMS of all reference
    gradients instead."""
    ref = [(jax.tree_util.keystr(path), np.asarray(leaf, np.float64))
           for path, leaf in jax.tree_util.tree_leaves_with_path(ref_grads)]
    typical = np.sqrt(np.mean([np.mean(np.square(g)) for _, g in ref]))
    errors = {}
    for (name, want), got in zip(ref, jax.tree_util.tree_leaves(grads)):
        got = np.asarray(got, np.float64)
        if "cmp_k" in name and "b2" in name:
            errors[name] = float(np.max(np.abs(got)) / typical)
        else:
            errors[name] = rel_err(got, want)
    return errors
