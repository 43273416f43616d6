"""Pallas selected attention against the plain-JAX reference beside it (and that reference
against the float64 brute force), forward and gradients.

CPU runs the kernels in interpret mode on small shapes; the `gpu` tests compile them for the GPU
and skip without one. Tolerances (spec): relative L2 error, float32 <= 1e-5 outputs / 1e-4
gradients, bfloat16 / float16 <= 1e-2, against a float32 reference on the same (rounded) inputs.
"""
import importlib
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import bruteforce
from nsa_common.testing import rel_err
from pallas_kernels.selected_attention import (
    BlockSizes,
    random_block_idx,
    selected_attention,
    selected_attention_reference,
    selected_attention_stages,
)

TOLERANCE = {  # dtype -> (outputs, gradients)
    jnp.float32: (1e-5, 1e-4),
    jnp.bfloat16: (1e-2, 1e-2),
    jnp.float16: (1e-2, 1e-2),
}

sa = importlib.import_module("pallas_kernels.selected_attention")  # the module, not the function
ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
# Device memory the 256k-token offset test asks for: it ran on 80 GB cards and out of memory in
# a 24 GiB pool.
OFFSET_TEST_BYTES = 32 * 2**30


def make_inputs(seed, B, T, H, G, d_k, d_v, n_sel, l_sel, dtype):
    # NumPy draws the values: no compilation per shape.
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    q = jnp.asarray(normal(B, T, H, d_k), dtype)
    k = jnp.asarray(normal(B, T, G, d_k), dtype)
    v = jnp.asarray(normal(B, T, G, d_v), dtype)
    block_idx = random_block_idx(jax.random.PRNGKey(seed), B, T, G, n_sel, l_sel)
    cotangent = jnp.asarray(normal(B, T, H, d_v))
    return q, k, v, block_idx, cotangent


def check_against_reference(q, k, v, block_idx, cotangent, l_sel, *, interpret,
                            block_sizes=None, scale=None):
    """Kernel forward and (dq, dk, dv) against the reference run in float32 on the same inputs."""
    out_tol, grad_tol = TOLERANCE[q.dtype.type]

    @jax.jit
    def kernel_and_reference(q, k, v, block_idx, cotangent):
        # One jit for both sides: interpret mode compiles once instead of op by op.
        def kernel(q, k, v):
            return selected_attention(q, k, v, block_idx, l_sel, scale, block_sizes=block_sizes,
                                      interpret=interpret)

        def reference(q, k, v):
            return selected_attention_reference(q, k, v, block_idx, l_sel, scale)

        o, pullback = jax.vjp(kernel, q, k, v)
        grads = pullback(cotangent.astype(o.dtype))
        o_ref, pullback_ref = jax.vjp(reference, *(x.astype(jnp.float32) for x in (q, k, v)))
        return o, grads, o_ref, pullback_ref(cotangent)

    o, grads, o_ref, grads_ref = kernel_and_reference(q, k, v, block_idx, cotangent)
    assert o.shape == q.shape[:3] + v.shape[3:] and o.dtype == q.dtype
    assert rel_err(o, o_ref) <= out_tol
    for name, grad, grad_ref, primal in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert grad.shape == primal.shape and grad.dtype == primal.dtype, name
        err = rel_err(grad, grad_ref)
        assert err <= grad_tol, f"{name}: relative error {err:.2e} > {grad_tol:.0e}"


# Every heads-per-group value, float32. T % l_sel != 0 everywhere, so the last block is partial;
# early queries have fewer than n_sel eligible blocks, so -1 padding is exercised; dkv_chunk = 5
# splits every block's query list into several work items (block 0's list holds all T queries).
# The large h run with a shorter T to keep interpret mode fast.
@pytest.mark.parametrize("h,B,G,T", [(1, 2, 2, 45), (2, 2, 2, 45), (4, 2, 2, 45), (8, 1, 2, 45),
                                     (16, 1, 1, 37), (32, 1, 1, 21)])
def test_float32_every_group_size(h, B, G, T):
    inputs = make_inputs(h, B, T, h * G, G, 16, 8, 4, 16, jnp.float32)
    check_against_reference(*inputs, 16, interpret=True, block_sizes=BlockSizes(dkv_chunk=5))


# The default dk/dv work item: 2 * n_sel * l_sel queries, cut to max(DKV_MIN_CHUNK, T / 16) at
# short T; with the limits scaled down, a run on the default cuts block lists into several items.
def test_default_dkv_chunk(monkeypatch):
    def geo(T, n_sel=16, l_sel=64):
        return types.SimpleNamespace(T=T, n_sel=n_sel, l_sel=l_sel)

    def chunk(g):
        return sa._dkv_chunk(g, BlockSizes())

    assert [chunk(geo(T)) for T in (4096, 8192, 16384, 32768, 65536)] == [512, 512, 1024, 2048,
                                                                           2048]
    assert chunk(geo(8192, n_sel=4, l_sel=32)) == 256  # uncut: 2 * n_sel * l_sel is smaller
    assert chunk(geo(300)) == 300  # at most T
    assert sa._dkv_chunk(geo(8192), BlockSizes(dkv_chunk=100)) == 100
    monkeypatch.setattr(sa, "DKV_MIN_CHUNK", 4)
    monkeypatch.setattr(sa, "DKV_ITEMS_PER_LIST", 8)
    assert chunk(geo(45, n_sel=4, l_sel=16)) == 5
    inputs = make_inputs(7, 2, 45, 4, 2, 16, 8, 4, 16, jnp.float32)
    check_against_reference(*inputs, 16, interpret=True, block_sizes=BlockSizes())


# Half precision: bfloat16 at the smallest and the matrix-unit group size, float16 once.
@pytest.mark.parametrize("dtype,h", [(jnp.bfloat16, 1), (jnp.bfloat16, 16), (jnp.float16, 4)])
def test_half_precision(dtype, h):
    T = 37 if h == 16 else 45
    inputs = make_inputs(10 + h, 2 if h < 16 else 1, T, h * 2, 2, 16, 8, 4, 16, dtype)
    check_against_reference(*inputs, 16, interpret=True, block_sizes=BlockSizes(dkv_chunk=9))


def test_head_dims_not_powers_of_two_and_odd_block():
    """d_k = 24 and d_v = 8 (the paper's 192/128 is d_k != d_v with d_k padded), a block size
    that is not a power of two (l_sel = 12 loads 16-key tiles), an explicit scale, the default
    work-item size, and more selected blocks than eligible ones."""
    inputs = make_inputs(3, 2, 50, 4, 2, 24, 8, 5, 12, jnp.float32)
    check_against_reference(*inputs, 12, interpret=True, scale=0.3)


def test_reference_matches_bruteforce(x64):
    """The reference (gather-based), whole and in query chunks, against the float64 dense-mask
    brute force of tests/."""
    q, k, v, block_idx, _ = make_inputs(4, 2, 40, 4, 2, 16, 8, 4, 16, jnp.float64)
    expected = bruteforce.bf_selected_attention(np.asarray(q), np.asarray(k), np.asarray(v),
                                                np.asarray(block_idx), 16)
    reference = jax.jit(selected_attention_reference, static_argnums=(4,),
                        static_argnames=("query_chunk",))
    assert rel_err(reference(q, k, v, block_idx, 16), expected) <= 1e-12
    assert rel_err(reference(q, k, v, block_idx, 16, query_chunk=16), expected) <= 1e-12


def test_random_block_idx_is_valid():
    B, T, G, n_sel, l_sel = 2, 150, 3, 5, 16
    block_idx = np.asarray(random_block_idx(jax.random.PRNGKey(5), B, T, G, n_sel, l_sel,
                                            query_chunk=64))
    assert block_idx.shape == (B, T, G, n_sel) and block_idx.dtype == np.int32
    last = (np.arange(T) // l_sel)[None, :, None, None]                # newest eligible block
    n_eligible = np.minimum(n_sel, last + 1)
    slot = np.arange(n_sel)
    chosen = slot < n_eligible
    assert np.all(np.where(chosen, block_idx >= 0, block_idx == -1))    # -1 only at the end
    assert np.all(np.where(chosen, block_idx <= last, True))
    ascending = np.diff(np.where(chosen, block_idx, np.iinfo(np.int32).max), axis=-1) > 0
    assert np.all(ascending | ~chosen[..., 1:])
    for forced in (0, last, np.maximum(last - 1, 0)):                 # n_init = 1, n_local = 2
        assert np.all(np.any(block_idx == forced, axis=-1))


def test_xla_implementation_is_the_reference():
    q, k, v, block_idx, _ = make_inputs(6, 1, 40, 4, 2, 16, 8, 4, 16, jnp.float32)
    got = selected_attention(q, k, v, block_idx, 16, implementation="xla")
    expected = jax.jit(selected_attention_reference, static_argnums=(4,))(q, k, v, block_idx, 16)
    assert rel_err(got, expected) <= 1e-6


@pytest.mark.parametrize("change,message", [
    (dict(block_idx_shape=(1, 40, 2)), "block_idx"),
    (dict(k_heads=3), "multiple"),
    (dict(block_size=0), "block_size"),
    (dict(implementation="mosaic"), "implementation"),
    (dict(k_dtype=jnp.bfloat16), "dtype"),
    (dict(d_k_of_k=8), "d_k"),
])
def test_bad_arguments_raise(change, message):
    q = jnp.zeros((1, 40, 4, 16))
    k = jnp.zeros((1, 40, change.get("k_heads", 2), change.get("d_k_of_k", 16)),
                  change.get("k_dtype", jnp.float32))
    v = jnp.zeros((1, 40, change.get("k_heads", 2), 8))
    block_idx = jnp.zeros(change.get("block_idx_shape", (1, 40, k.shape[2], 4)), jnp.int32)
    with pytest.raises(ValueError, match=message):
        selected_attention(q, k, v, block_idx, change.get("block_size", 16), interpret=True,
                           implementation=change.get("implementation", "triton"))


def test_stages_compose_to_the_kernel():
    """`selected_attention_stages` (the benches' per-stage entry) runs the kernel's own functions:
    forward, dq and dk/dv from them equal `selected_attention`'s output and gradients (to
    float32 rounding: the glue around the kernels is compiled in another context, and XLA may
    fuse it differently), and the inverse index is the dk/dv pass's work list."""
    q, k, v, block_idx, cotangent = make_inputs(3, 1, 80, 4, 2, 16, 8, 3, 16, jnp.float32)
    stages = selected_attention_stages(q, k, v, block_idx, 16, interpret=True)
    o, lse = stages.forward(q, k, v)
    do = cotangent.astype(o.dtype)
    delta = jnp.sum(o * do, axis=-1)
    dq = stages.backward_dq(q, k, v, do, lse, delta)
    dk, dv = stages.backward_dkv(q, k, v, do, lse, delta)
    @jax.jit
    def output_and_grads(q, k, v, do):
        o, pullback = jax.vjp(lambda q, k, v: selected_attention(q, k, v, block_idx, 16,
                                                                interpret=True), q, k, v)
        return (o, *pullback(do))

    for got, want in zip((o, dq, dk, dv), output_and_grads(q, k, v, do)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    item_block = stages.inverse_index(block_idx)[1]
    assert item_block.shape[-1] >= stages.dkv_work_items > 0


def test_dk_parts():
    """d_k enters the products whole (a power of two), as two power-of-two parts >= 16
    (`split_dk`), or padded to the next power of two."""
    from pallas_kernels.selected_attention import _Geometry

    def parts(d_k, split=True):
        return _Geometry(B=1, T=8, H=2, G=1, d_k=d_k, d_v=8, n_sel=1, l_sel=16,
                         split_dk=split).dk_parts

    assert parts(128) == ((0, 128),) and parts(8) == ((0, 16),)
    assert parts(192) == ((0, 128), (128, 64)) and parts(96) == ((0, 64), (64, 32))
    assert parts(80) == ((0, 64), (64, 16))
    assert parts(192, split=False) == ((0, 256),)
    assert parts(40) == ((0, 64),) and parts(24) == ((0, 32),)   # a part under 16: padded
    assert parts(200) == ((0, 256),)                             # not two powers of two


@pytest.mark.parametrize("d_k,split", [(48, True), (48, False), (96, True)])
def test_dk_split_into_two_parts(d_k, split):
    """The split products (d_k = 32 + 16, 64 + 32) against the reference, forward and every
    gradient, and the padded form for the same shapes."""
    inputs = make_inputs(20 + d_k, 1, 45, 4, 2, d_k, 8, 4, 16, jnp.float32)
    check_against_reference(*inputs, 16, interpret=True,
                            block_sizes=BlockSizes(dkv_chunk=7, split_dk=split))


# Token tiles: a forward / dq program of 2-8 tokens, shared blocks loaded once (stack False),
# or the tokens' rows stacked over the union of their blocks (stack True).
@pytest.mark.parametrize("tokens_fwd,tokens_dq,d_k,dtype,stack", [
    pytest.param(8, 4, 16, jnp.float32, False, marks=pytest.mark.slow),
    (2, 8, 48, jnp.float32, False),
    pytest.param(4, 4, 16, jnp.bfloat16, False, marks=pytest.mark.slow),
    (4, 2, 48, jnp.float32, True),
    pytest.param(8, 8, 16, jnp.bfloat16, True, marks=pytest.mark.slow)])
def test_token_tiles_against_reference(tokens_fwd, tokens_dq, d_k, dtype, stack):
    """T = 60 (a partial last block; tiles of 4 divide it, and a tile of 8 shrinks to 4), h = 4,
    random spec-form block lists of 4 among 8 blocks of 8 tokens: the forced initial and local
    blocks are shared inside a tile, the fourth block is mostly a token's own; d_k 48 is split
    into 32 + 16."""
    inputs = make_inputs(30 + tokens_fwd, 2, 60, 8, 2, d_k, 8, 4, 8, dtype)
    check_against_reference(*inputs, 8, interpret=True, block_sizes=BlockSizes(
        dkv_chunk=7, tokens_fwd=tokens_fwd, tokens_dq=tokens_dq, stack_tokens=stack))


def test_token_tiles_with_repeats_gaps_and_late_blocks():
    """Block lists outside the spec's form, which the reference still defines: a block repeated
    in a list (counted twice), -1 between blocks, blocks that start after the token or lie past
    T, and one list shared by a whole tile; token tiles of 4 (and a T of 36 that 8 does not
    divide, so a tile of 8 shrinks to 4)."""
    B, T, H, G, n_sel, l_sel = 1, 36, 4, 2, 6, 8
    q, k, v, _, cotangent = make_inputs(41, B, T, H, G, 16, 8, n_sel, l_sel, jnp.float32)
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, T // l_sel + 3, size=(B, T, G, n_sel)).astype(np.int32)
    idx[:, :, :, 1] = idx[:, :, :, 0]                   # a repeat in every list
    idx[:, 8:12, 0, :] = [0, 2, -1, 1, 1, 0]            # one list for a whole tile, with repeats
    idx[:, 12:16, 1, :] = [[3, 1, 0, -1, 0, 9], [1, -1, -1, 3, 3, 0], [0, 1, 1, 1, 2, 2],
                           [-1, -1, -1, -1, -1, -1]]
    for tokens, stack in ((4, False), (8, False), (4, True), (2, True)):
        check_against_reference(q, k, v, jnp.asarray(idx), cotangent, l_sel, interpret=True,
                                block_sizes=BlockSizes(dkv_chunk=5, tokens_fwd=tokens,
                                                       tokens_dq=tokens, stack_tokens=stack))


def test_stacked_tile_union():
    """The union list of a stacked tile: ascending, each block once, -1 and blocks past the
    tile's last token left out, -1 padded; against Python sets."""
    from pallas_kernels.selected_attention import _Geometry, _tile_union

    B, T, G, n, l_sel, tokens = 2, 32, 3, 4, 4, 4
    rng = np.random.default_rng(3)
    idx = rng.integers(-1, 10, size=(B, T, G, n)).astype(np.int32)
    geo = _Geometry(B=B, T=T, H=G, G=G, d_k=16, d_v=16, n_sel=n, l_sel=l_sel)
    union = np.asarray(_tile_union(jnp.asarray(idx), geo, tokens))
    assert union.shape == (B, T // tokens, G, tokens * n)
    for b in range(B):
        for i in range(T // tokens):
            last = i * tokens + tokens - 1
            for g in range(G):
                want = sorted({int(j) for j in idx[b, i * tokens:last + 1, g].ravel()
                               if 0 <= j and j * l_sel <= last})
                got = union[b, i, g]
                assert list(got[:len(want)]) == want and (got[len(want):] == -1).all()


def test_stacked_tiles_split_by_union_size(monkeypatch):
    """`stack_max_union`: the tiles whose union holds at most that many blocks are written by
    the stacked kernel, the others by the per-token kernel (both replaced by kernels that write
    their own mark, forward and dq); and the split against the reference, forward and
    gradients, on tiles of 4 (dq: 2) whose union sizes span the threshold."""
    B, T, H, G, d, n_sel, l_sel, P = 2, 60, 8, 2, 48, 4, 8, 4
    inputs = make_inputs(34, B, T, H, G, d, 8, n_sel, l_sel, jnp.float32)
    q, k, v, idx, do = inputs
    geo = sa._Geometry(B=B, T=T, H=H, G=G, d_k=d, d_v=8, n_sel=n_sel, l_sel=l_sel)
    count = (np.asarray(sa._tile_union(jnp.asarray(idx), geo, P)) >= 0).sum(-1)  # [B, T/P, G]
    max_union = int(np.median(count))
    assert (count <= max_union).any() and (count > max_union).any()
    check_against_reference(*inputs, l_sel, interpret=True, block_sizes=BlockSizes(
        dkv_chunk=7, tokens_fwd=P, tokens_dq=2, stack_tokens=True, stack_max_union=max_union))

    def marking(mark, n_in):
        def kernel(*refs, program=None, **kwargs):
            for ref in refs[n_in:]:
                ref[...] = jnp.full(ref.shape, mark, ref.dtype)
        return kernel

    for name, n_in in (("_fwd_kernel", 4), ("_dq_kernel", 7)):
        monkeypatch.setattr(sa, name, marking(1.0, n_in))
    for name, n_in in (("_fwd_stack_kernel", 5), ("_dq_stack_kernel", 8)):
        monkeypatch.setattr(sa, name, marking(2.0, n_in))
    bs = BlockSizes(tokens_fwd=P, tokens_dq=P, stack_tokens=True, stack_max_union=max_union,
                    num_warps_stack=4)
    stages = sa.selected_attention_stages(q, k, v, idx, l_sel, block_sizes=bs, interpret=True)
    o, lse = stages.forward(q, k, v)
    dq = stages.backward_dq(q, k, v, do, lse, jnp.zeros(lse.shape, jnp.float32))
    want = np.where(np.repeat(count <= max_union, P, axis=1), 2.0, 1.0)     # [B, T, G]
    for name, x in (("o", o), ("lse", lse), ("dq", dq)):
        got = np.asarray(x, np.float32).reshape(B, T, G, -1)
        np.testing.assert_array_equal(got, np.broadcast_to(want[..., None], got.shape),
                                      err_msg=name)


def test_token_tile_sizes_are_checked():
    for bad in (0, 1, "yes"):
        with pytest.raises(ValueError, match="stack_tokens"):
            BlockSizes(tokens_fwd=2, stack_tokens=bad)
    with pytest.raises(ValueError, match="tokens_fwd or tokens_dq > 1"):
        BlockSizes(stack_tokens=True)
    for name in ("stack_max_union", "num_warps_stack"):
        with pytest.raises(ValueError, match=f"{name} .* needs stack_tokens=True"):
            BlockSizes(tokens_fwd=4, **{name: 8})
        for bad in (0, -1, True, 8.0):
            with pytest.raises(ValueError, match=name):
                BlockSizes(tokens_fwd=4, stack_tokens=True, **{name: bad})
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(ValueError, match="tokens_fwd"):
            BlockSizes(tokens_fwd=bad)
        with pytest.raises(ValueError, match="tokens_dq"):
            BlockSizes(tokens_dq=bad)


def test_stacked_tiles_through_the_public_call():
    """The stacked tiles as docs/API.md gives them to a user (`PallasOptions.selected_blocks`
    through `nsa_jax.selected_attention`), forward and gradients against the reference."""
    import nsa_jax
    from nsa_jax import PallasOptions

    l_sel = 8
    q, k, v, block_idx, cotangent = make_inputs(53, 1, 48, 8, 2, 16, 8, 4, l_sel, jnp.float32)
    options = {"pallas": PallasOptions(selected_blocks=BlockSizes(
        tokens_fwd=4, tokens_dq=4, stack_tokens=True, num_warps_fwd=4, num_warps_dq=4))}

    def run(fn, *xs):
        out, pullback = jax.vjp(fn, *xs)
        return (out, *pullback(cotangent.astype(out.dtype)))

    got = run(lambda q, k, v: nsa_jax.selected_attention(
        q, k, v, block_idx, l_sel, backend="pallas", options=options), q, k, v)
    want = run(lambda q, k, v: selected_attention_reference(q, k, v, block_idx, l_sel), q, k, v)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) <= (1e-5 if name == "o" else 1e-4), name


def test_default_stacked_tile_fits_the_group_rows(monkeypatch):
    """The architecture's stacked tile (sm90: 4 tokens of up to 16 heads) holds at most
    `STACK_ROWS` query rows: 2 tokens of 32 heads (half the union bound), one token a program
    from 64 heads; a caller's own block sizes are kept as given."""
    from pallas_kernels import profiles

    monkeypatch.setenv("NSA_PROFILE", "sm90")
    x = lambda H: jnp.zeros((1, 8, H, 128), jnp.bfloat16)  # noqa: E731
    base = profiles.block_sizes("selected", jnp.bfloat16, 128, 128)
    assert (base.tokens_fwd, base.stack_tokens, base.stack_max_union) == (4, True, 32)
    assert sa._default_block_sizes(x(16), x(1), x(1), None) == base
    two = sa._default_block_sizes(x(32), x(1), x(1), None)
    assert (two.tokens_fwd, two.tokens_dq, two.stack_tokens, two.stack_max_union) == \
        (2, 2, True, 16)
    one = sa._default_block_sizes(x(64), x(1), x(1), None)
    assert (one.tokens_fwd, one.tokens_dq, one.stack_tokens, one.stack_max_union,
            one.num_warps_stack) == (1, 1, False, None, None)
    mine = BlockSizes(tokens_fwd=8, tokens_dq=8, stack_tokens=True)
    assert sa._default_block_sizes(x(32), x(1), x(1), mine) is mine


# --- GPU: the compiled Triton kernels -----------------------------------------------------------

@gpu
@needs_gpu
@pytest.mark.parametrize("dtype,h,d_k,d_v,T", [
    (jnp.bfloat16, 16, 192, 128, 1000),   # the paper's head dims, T % 64 != 0
    (jnp.float32, 16, 128, 128, 700),
    (jnp.bfloat16, 1, 64, 64, 600),
    (jnp.float16, 32, 128, 64, 500),
    (jnp.bfloat16, 4, 128, 128, 777),
])
def test_gpu_against_reference(dtype, h, d_k, d_v, T):
    inputs = make_inputs(7, 2, T, 2 * h, 2, d_k, d_v, 16, 64, dtype)
    check_against_reference(*inputs, 64, interpret=False,
                            block_sizes=BlockSizes(dkv_chunk=256))


@gpu
@needs_gpu
@pytest.mark.parametrize("tokens,d_k,T,stack,warps,max_union", [
    (4, 128, 1024, False, 4, None), (8, 192, 1000, False, 4, None),
    (2, 128, 768, False, 4, None), (2, 128, 768, True, 4, None), (4, 128, 1024, True, 4, None),
    (4, 128, 1024, True, 8, None), (8, 192, 1000, True, 8, None), (4, 128, 1024, True, 2, 12),
    (4, 192, 1000, True, 2, 12)])
def test_gpu_token_tiles_against_reference(tokens, d_k, T, stack, warps, max_union):
    """Token tiles compiled, loaded once or stacked (T 1000: a tile of 8 shrinks to 8, the last
    block partial); with `max_union`, the early tiles (unions of at most 12 of the 16 blocks)
    stacked on 4 warps and the others per token on `warps`."""
    inputs = make_inputs(9, 1, T, 64, 4, d_k, 128, 16, 64, jnp.bfloat16)
    split = {} if max_union is None else dict(stack_max_union=max_union, num_warps_stack=4)
    check_against_reference(*inputs, 64, interpret=False, block_sizes=BlockSizes(
        dkv_chunk=256, tokens_fwd=tokens, tokens_dq=tokens, num_warps_fwd=warps,
        num_warps_dq=warps, stack_tokens=stack, **split))


@gpu
@needs_gpu
@pytest.mark.parametrize("workload", ["random", "coherent"])
def test_gpu_default_tiles_against_reference(workload):
    """The architecture's own tiles (on sm90: tiles of 4 stacked where their union holds at
    most 32 blocks, else one token a program), bf16, the bench preset's heads, on a random
    selection and on one whose odd queries repeat their even neighbour's list."""
    q, k, v, block_idx, cotangent = make_inputs(10, 1, 4096, 64, 4, 128, 128, 16, 64,
                                                jnp.bfloat16)
    if workload == "coherent":
        block_idx = block_idx.at[:, 1::2].set(block_idx[:, 0::2])
    check_against_reference(q, k, v, block_idx, cotangent, 64, interpret=False)


@gpu
@needs_gpu
def test_gpu_gradients_are_deterministic():
    """dk, dv come from a KV-block-major pass without atomics: bitwise equal run to run."""
    q, k, v, block_idx, cotangent = make_inputs(8, 1, 2048, 64, 4, 128, 128, 16, 64,
                                                jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        selected_attention(q, k, v, block_idx, 64).astype(jnp.float32) * cotangent),
        argnums=(0, 1, 2)))
    first = grad(q, k, v)
    for _ in range(3):
        again = grad(q, k, v)
        for a, b in zip(first, again):
            assert np.array_equal(np.asarray(a), np.asarray(b))


@gpu
@needs_gpu
def test_gpu_256k_tokens_no_offset_overflow():
    """T = 2^18 with H 64 and d 128: q and o hold 2^31 elements, so 32-bit element offsets
    would wrap. Rows near the end (the largest offsets) are checked against a direct
    computation over their gathered keys, and the gradient of q must be finite. q, o, the
    cotangent and dq are 4 GiB each: skipped where the device's allocator holds less than
    OFFSET_TEST_BYTES (in a 24 GiB pool, the RTX 4090 plan's, it ran out of memory)."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is not None and limit < OFFSET_TEST_BYTES:
        pytest.skip(f"needs {OFFSET_TEST_BYTES / 2**30:.0f} GiB of device memory, the "
                    f"allocator holds {limit / 2**30:.1f} GiB")
    B, T, H, G, d, l_sel, n_sel = 1, 2 ** 18, 64, 4, 128, 64, 16
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    q = jax.random.normal(keys[0], (B, T, H, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, G, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, G, d), jnp.bfloat16)
    block_idx = random_block_idx(keys[3], B, T, G, n_sel, l_sel)
    o = selected_attention(q, k, v, block_idx, l_sel)
    h, scale = H // G, 1.0 / np.sqrt(d)
    for t in (T - 1, T - 777, T // 2 + 5):
        for g in (0, G - 1):
            chosen = [j for j in np.asarray(block_idx[0, t, g]) if j >= 0]
            tokens = np.concatenate([np.arange(j * l_sel, min((j + 1) * l_sel, t + 1))
                                     for j in chosen])
            qg = np.asarray(q[0, t, g * h:(g + 1) * h], np.float32)
            scores = qg @ np.asarray(k[0, tokens, g], np.float32).T * scale
            p = np.exp(scores - scores.max(-1, keepdims=True))
            expected = (p / p.sum(-1, keepdims=True)) @ np.asarray(v[0, tokens, g], np.float32)
            got = np.asarray(o[0, t, g * h:(g + 1) * h], np.float32)
            assert np.linalg.norm(got - expected) <= 1e-2 * np.linalg.norm(expected), (t, g)
    dq = jax.grad(lambda q: jnp.sum(selected_attention(q, k, v, block_idx, l_sel)
                                    .astype(jnp.float32)))(q)
    assert bool(jnp.all(jnp.isfinite(dq[0, -4096:])))


@pytest.mark.parametrize("B,T,H,G,d_k,d_v,l_sel,n_sel,dtype", [
    (1, 300, 64, 4, 192, 128, 64, 16, jnp.bfloat16),   # the paper's shapes (128 + 64)
    (1, 100, 8, 2, 96, 64, 32, 4, jnp.bfloat16),       # 64 + 32
    (2, 100, 2, 2, 24, 8, 12, 5, jnp.float32),         # h = 1, nothing a power of two
    (1, 100, 32, 1, 16, 16, 16, 4, jnp.float16),
])
def test_lowers_to_triton_on_any_host(B, T, H, G, d_k, d_v, l_sel, n_sel, dtype):
    """Forward and backward lower through the Pallas Triton lowering for the CUDA platform even
    on a CPU-only host: this catches what interpret mode accepts but Triton lowering refuses
    (non power-of-two blocks, unsupported primitives). Compiling the Triton IR needs the GPU."""
    shape = jax.ShapeDtypeStruct
    args = (shape((B, T, H, d_k), dtype), shape((B, T, G, d_k), dtype),
            shape((B, T, G, d_v), dtype), shape((B, T, G, n_sel), jnp.int32))

    def grads(q, k, v, block_idx):
        loss = lambda q, k, v: jnp.sum(
            selected_attention(q, k, v, block_idx, l_sel).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    lowered = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # Forward, dq, dk/dv and the dk/dv reduction are four Triton custom calls; tiles split by
    # union size launch the forward and dq twice (per token, stacked).
    split = sa._default_block_sizes(*args[:3], None).stack_max_union is not None
    assert lowered.count("xla.gpu.triton") == 4 + 2 * split
