"""The selected branch's per-slot attention mass (`pallas_kernels.selected_block_mass`, interpret
mode on CPU; the `gpu` tests compile it) against its plain-JAX reference, that reference against
a NumPy float64 brute force, and the XLA dispatch entry (chunked, packed sequences) against both;
the selection-alignment loss on the kernel equals it on XLA. Its fit on sm80 / sm89:
test_arch_profiles.py::test_every_kernel_fits."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_jax
from conftest import enable_x64, jax_has_gpu
from jax_inputs import make_inputs as layer_inputs
from nsa_common import NSAConfig
from nsa_jax.segments import from_cu_seqlens
from nsa_jax.xla import selected_block_mass as xla_block_mass
from pallas_kernels.selected_attention import BlockSizes, random_block_idx
from pallas_kernels.selected_block_mass import (selected_block_mass,
                                                selected_block_mass_reference)

# B 2, T 100 (the last block partial), h = 3 (query rows padded to 16), d_k 96 (two column
# parts), l_sel 16, n_sel 5 (slots padded to 8); one slot emptied (-1) and one pointing past t.
SHAPE = dict(B=2, T=100, H=6, G=2, d_k=96, l_sel=16, n_sel=5)
EMPTY_AT = lambda T: 7 * T // 10  # noqa: E731 (the query whose last slot is -1)
LATE_AT = lambda T: 4 * T // 10   # noqa: E731 (the query whose last slot starts after it)

# The reference jitted (l_sel static): one compilation a shape instead of one an operation.
reference = jax.jit(selected_block_mass_reference, static_argnums=3)


def make_inputs(dtype, seed=0, B=2, T=100, H=6, G=2, d_k=96, l_sel=16, n_sel=5):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (B, T, H, d_k), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, G, d_k), jnp.float32).astype(dtype)
    idx = np.array(random_block_idx(keys[2], B, T, G, n_sel, l_sel))
    empty, late = EMPTY_AT(T), LATE_AT(T)
    idx[0, empty, G - 1, -1] = -1
    idx[B - 1, late, 0, -1] = late // l_sel + 1     # starts after the query: nothing attended
    return q, k, jnp.asarray(idx)


def bruteforce(q, k, idx, l_sel):
    """float64 loops: per (b, t, g), each head's softmax over the selected tokens <= t, its
    mass per slot summed over the group's heads, logged."""
    q, k, idx = (np.asarray(a, np.float64) for a in (q, k, idx))
    B, T, H, d = q.shape
    G = k.shape[2]
    h = H // G
    out = np.full(idx.shape, -np.inf)
    for b in range(B):
        for t in range(T):
            for g in range(G):
                slots = [[s for s in range(int(j) * l_sel, min(int(j + 1) * l_sel, t + 1))]
                         if j >= 0 else [] for j in idx[b, t, g]]
                tokens = [s for block in slots for s in block]
                mass = np.zeros(len(slots))
                for head in range(g * h, (g + 1) * h):
                    s = k[b, tokens, g] @ q[b, t, head] / np.sqrt(d)
                    p = np.exp(s - s.max())
                    p /= p.sum()
                    start = 0
                    for i, block in enumerate(slots):
                        mass[i] += p[start:start + len(block)].sum()
                        start += len(block)
                out[b, t, g] = np.where(mass > 0, np.log(np.maximum(mass, 1e-300)), -np.inf)
    return out


def test_reference_matches_float64_bruteforce():
    q, k, idx = make_inputs(jnp.float32, B=1, T=40, H=4, G=2, d_k=8, l_sel=8, n_sel=3)
    with enable_x64():
        got = reference(*(jnp.asarray(np.asarray(a, np.float64)) for a in (q, k)), idx, 8)
    want = bruteforce(q, k, idx, 8)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(np.where(np.isfinite(want), got, 0),
                               np.where(np.isfinite(want), want, 0), rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def float32_case():
    q, k, idx = make_inputs(jnp.float32)
    with enable_x64():
        ref = np.asarray(reference(*(jnp.asarray(np.asarray(a, np.float64)) for a in (q, k)),
                                   idx, SHAPE["l_sel"]))
    return q, k, idx, ref


def assert_close(got, ref, atol):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=atol, rtol=0)


def test_kernel_matches_float64_reference(float32_case):
    q, k, idx, ref = float32_case
    got = jax.jit(functools.partial(selected_block_mass, block_size=SHAPE["l_sel"],
                                    block_sizes=BlockSizes(), interpret=True))(q, k, idx)
    assert got.shape == idx.shape and got.dtype == jnp.float32
    got_np = np.asarray(got)
    assert np.isneginf(got_np[0, EMPTY_AT(100), 1, -1])
    assert np.isneginf(got_np[1, LATE_AT(100), 0, -1])
    # The masses of a (query, group) sum to its h heads.
    np.testing.assert_allclose(np.sum(np.exp(np.asarray(got)), axis=-1), 3.0, rtol=1e-5)
    assert_close(got, ref, atol=1e-5)


def test_xla_entry_matches_reference_chunked_and_packed(float32_case):
    q, k, idx, ref = float32_case
    l_sel = SHAPE["l_sel"]
    scale = SHAPE["d_k"] ** -0.5
    got = jax.jit(functools.partial(xla_block_mass, block_size=l_sel, scale=scale, q_chunk=32,
                                    kv_blocks=2))(q, k, idx)
    assert_close(got, ref, atol=1e-5)
    # Two sequences packed in one row: each sequence's own local blocks and positions.
    cfg = NSAConfig.tiny(sel_block=l_sel)
    T1 = 48
    segments = from_cu_seqlens(jnp.asarray([0, T1, 100], jnp.int32), 100, cfg)
    pos = np.asarray(segments.pos)
    q, k, idx = (np.asarray(a) for a in (q, k, idx))
    local_idx = np.concatenate([idx[:1, :T1], idx[:1, :52]], axis=1)
    packed_k = np.concatenate([k[:1, :T1], k[1:, :52]], axis=1)
    packed_q = np.concatenate([q[:1, :T1], q[1:, :52]], axis=1)
    packed = jax.jit(lambda q, k, idx: xla_block_mass(q, k, idx, block_size=l_sel, scale=scale,
                                                      segments=segments))
    got = packed(packed_q, packed_k, local_idx)
    first = reference(q[:1, :T1], k[:1, :T1], idx[:1, :T1], l_sel)
    second = reference(q[1:, :52], k[1:, :52], idx[1:, :52], l_sel)
    assert pos[T1] == 0
    assert_close(got, np.concatenate([first, second], axis=1).astype(np.float64), atol=1e-5)


def test_bad_inputs_and_float64():
    q, k, idx = make_inputs(jnp.float32, B=1, T=20, H=2, G=1, d_k=8, l_sel=8, n_sel=2)
    with pytest.raises(ValueError, match="block_idx"):
        selected_block_mass(q, k, idx[..., 0], 8, interpret=True)
    with pytest.raises(ValueError, match="block_size"):
        selected_block_mass(q, k, idx, 0, interpret=True)
    with enable_x64():
        q64 = jnp.asarray(np.asarray(q, np.float64))
        with pytest.raises(NotImplementedError, match="float64"):
            selected_block_mass(q64, q64[:, :, :1], idx, 8, interpret=True)


def test_alignment_loss_on_the_kernel_equals_xla():
    cfg = NSAConfig.tiny(n_sel=5, n_local=1)
    params, x = layer_inputs(cfg, 2, 112, jnp.float32, seed=3)
    alignment = nsa_jax.AlignmentOptions(mode="sparse")
    options = {"pallas": nsa_jax.PallasOptions(interpret=True)}

    def loss(backend, opts):
        return jax.jit(jax.value_and_grad(lambda p: nsa_jax.selection_alignment_loss(
            p, x, cfg, alignment=alignment, backend=backend, options=opts)))(params)

    (l_xla, g_xla), (l_pallas, g_pallas) = loss("xla", None), loss("pallas", options)
    assert float(l_xla) > 1e-3
    assert float(l_pallas) == pytest.approx(float(l_xla), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_pallas), jax.tree_util.tree_leaves(g_xla)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [dict(B=1, T=2048, H=64, G=4, d_k=128, l_sel=64, n_sel=16),
                                  dict(B=1, T=1000, H=64, G=4, d_k=192, l_sel=64, n_sel=16),
                                  SHAPE])
def test_gpu_matches_reference(dtype, case):
    """Against the float32 reference on the same (rounded) inputs, whose products a 16-bit
    kernel also takes exactly (float32 accumulation): log masses within 1e-4 (float32) and 1e-3
    (16-bit, where the accumulation order of the longer sums shows)."""
    q, k, idx = make_inputs(dtype, **case)
    got = np.asarray(selected_block_mass(q, k, idx, case["l_sel"]), np.float64)
    f32 = [a.astype(jnp.float32) for a in (q, k)]
    ref = np.asarray(selected_block_mass_reference(*f32, idx, case["l_sel"]), np.float64)
    assert_close(got, ref, atol=1e-4 if dtype == jnp.float32 else 1e-3)

