"""Block sizes per GPU architecture (`pallas_kernels.profiles`): how a profile is chosen, that
sm90 keeps the tuned tiles, that every kernel runs its architecture's tiles correctly (interpret
mode, against the references), that a shape without tiles falls through to XLA, and that the
tiles of sm80 / sm89 fit their shared memory when compiled for them (`scripts/pallas_ptxas.py`);
which path (FA-3, cuDNN, the Pallas kernel, XLA) runs the window and compressed branches of
backend "pallas" per architecture, head size and sharding."""
import contextlib
import csv
import dataclasses
import functools
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_common import NSAConfig
from nsa_common.testing import rel_err
from conftest import enable_x64
from nsa_jax import dispatch, pallas_backend, sharding
from pallas_kernels import decode, profiles
from pallas_kernels.compressed_attention import (FLOAT32_BLOCK_SIZES, compressed_attention,
                                                 compressed_attention_reference)
from pallas_kernels.compressed_attention import BlockSizes as CompressedBlockSizes
from pallas_kernels.select_blocks import BlockSizes as SelectBlockSizes
from pallas_kernels.select_blocks import select_blocks, select_blocks_reference
from pallas_kernels.selected_attention import BlockSizes as SelectedBlockSizes
from pallas_kernels.selected_attention import (random_block_idx, selected_attention,
                                               selected_attention_reference)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pallas_ptxas.py")
BF16_TOL = 2e-2   # bfloat16 inputs against the float32 reference, outputs and gradients


# ----------------------------------------------------------------------------------------------
# Choosing a profile


def test_cpu_takes_sm90_and_the_environment_wins(monkeypatch):
    monkeypatch.delenv("NSA_PROFILE", raising=False)
    assert profiles.resolve()[0] == "sm90"          # no GPU here: interpret mode, sm90's tiles
    monkeypatch.setenv("NSA_PROFILE", "base")       # the PyTorch name for "the device decides"
    assert profiles.resolve()[0] == "sm90"
    for name in ("sm80", "sm86", "sm89", "sm90"):
        monkeypatch.setenv("NSA_PROFILE", name)
        assert profiles.resolve() == (name, f"NSA_PROFILE={name} (env)")
        assert profiles.current().name == name
    monkeypatch.setenv("NSA_PROFILE", "sm00")
    with pytest.raises(ValueError, match=r"NSA_PROFILE \('sm00'\) must be one of"):
        profiles.current()


@pytest.mark.parametrize("capability, name", [
    ("8.0", "sm80"), ("8.6", "sm86"), ("8.7", "sm86"), ("8.9", "sm89"), ("9.0", "sm90"),
    ("10.0", "sm90"), ("12.0", "sm89"), ((7, 5), "sm86")])
def test_compute_capability_picks_the_profile(capability, name):
    assert profiles.profile_for_capability(capability) == name


def test_shared_memory_and_hopper_only_paths():
    limits = {name: p.shared_memory for name, p in profiles.PROFILES.items()}
    assert limits == {"sm80": 166_912, "sm86": 101_376, "sm89": 101_376, "sm90": 232_448}
    # FlashAttention-3 and cuDNN's wide heads are Hopper's only.
    assert [name for name, p in profiles.PROFILES.items() if p.fa3] == ["sm90"]
    assert {p.cudnn_max_head_dim for name, p in profiles.PROFILES.items() if name != "sm90"} == {
        128}


def test_sm90_keeps_the_tuned_tiles():
    sm90 = profiles.PROFILES["sm90"]
    for d_k, d_v in ((128, 128), (192, 128), (128, 256), (64, 16)):
        assert sm90.block_sizes("compressed", jnp.bfloat16, d_k, d_v) == CompressedBlockSizes()
    for d_k, d_v in ((256, 256), (512, 512)):  # the dq kernel's tuned tiles overflow there
        assert sm90.block_sizes("compressed", jnp.bfloat16, d_k, d_v) == CompressedBlockSizes(
            block_q_dq=64)
    for d_k, d_v in ((128, 128), (192, 128), (256, 256), (512, 512)):
        assert sm90.block_sizes("compressed", jnp.float32, d_k, d_v) == FLOAT32_BLOCK_SIZES
        assert sm90.block_sizes("select", jnp.bfloat16, d_k) == SelectBlockSizes()
        assert sm90.block_sizes("selected", jnp.float32, d_k, d_v) == SelectedBlockSizes()
        assert sm90.block_sizes("decode", jnp.bfloat16, d_k, d_v) == decode.DecodeBlockSizes()
    # selected attention: tiles of 4 stacked by union size up to d 128, else one token
    stacked = SelectedBlockSizes(tokens_fwd=4, tokens_dq=4, stack_tokens=True,
                                 stack_max_union=32, num_warps_stack=4)
    for dtype in (jnp.bfloat16, jnp.float16):
        for d_k, d_v in ((128, 128), (64, 64), (128, 64)):
            assert sm90.block_sizes("selected", dtype, d_k, d_v) == stacked
        for d_k, d_v in ((192, 128), (256, 256), (512, 512)):
            assert sm90.block_sizes("selected", dtype, d_k, d_v) == SelectedBlockSizes()


@pytest.mark.parametrize("name", ["sm80", "sm86", "sm89"])
def test_tiers_serve_heads_up_to_256_and_decline_wider(name):
    profile = profiles.PROFILES[name]
    for kernel in profiles.KERNELS:
        narrow = profile.block_sizes(kernel, jnp.bfloat16, 64, 64)
        assert profile.block_sizes(kernel, jnp.bfloat16, 128) == narrow       # no values
        assert profile.block_sizes(kernel, jnp.bfloat16, 192) == profile.block_sizes(
            kernel, jnp.bfloat16, 192, 192)
        wide = profile.block_sizes(kernel, jnp.bfloat16, 256, 256)
        assert profile.block_sizes(kernel, jnp.bfloat16, 128, 256) == wide   # the wider head
        paper = profile.block_sizes(kernel, jnp.bfloat16, 192, 128)
        if kernel == "compressed" and name != "sm90":
            # d_k 192 read as 128 + 64 columns: a tier of its own, between 128 and 256.
            assert paper not in (wide, narrow)
            assert profile.block_sizes(kernel, jnp.bfloat16, 256, 128) == wide
        else:
            assert paper == wide
        assert profile.block_sizes(kernel, jnp.bfloat16, 128, 128) == narrow
        with pytest.raises(NotImplementedError, match=f"no {name} tiles for head dims"):
            profile.block_sizes(kernel, jnp.bfloat16, 320, 128)


# ----------------------------------------------------------------------------------------------
# The tiles of each architecture run correctly (interpret mode)

CFG = NSAConfig(d_model=64, n_heads=4, n_kv_heads=2, cmp_block=8, cmp_stride=4, sel_block=16,
                n_sel=4, n_init=1, n_local=2, window=16)


def _normal(rng, *shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


@pytest.mark.parametrize("profile, d_k, d_v", [
    ("sm89", 192, 128),   # the paper's heads on an RTX 4090's tiles: the default run
    pytest.param("sm89", 64, 32, marks=pytest.mark.slow),
    pytest.param("sm90", 192, 128, marks=pytest.mark.slow),
    pytest.param("sm90", 64, 32, marks=pytest.mark.slow),
])
def test_kernels_run_the_profile_tiles(monkeypatch, profile, d_k, d_v):
    """Default tiles (block_sizes=None) of `profile` against the references: compressed
    attention and its gradients, the selection, selected attention and its gradients."""
    monkeypatch.setenv("NSA_PROFILE", profile)
    rng = np.random.default_rng(0)
    B, T, H, G, l, d = 1, 70, CFG.n_heads, CFG.n_kv_heads, CFG.cmp_block, CFG.cmp_stride
    C = (T - l) // d + 1
    q = _normal(rng, B, T, H, d_k)
    k_cmp, v_cmp = _normal(rng, B, C, G, d_k), _normal(rng, B, C, G, d_v)
    geometry = dict(cmp_block=l, cmp_stride=d)

    def compressed_loss(fn, *args, **kw):
        o, lse = fn(*args, **geometry, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse),
                                                                       lse, 0.0))

    # Each side jitted whole: one compilation instead of one an operation.
    kernel_grad = jax.jit(jax.grad(
        lambda *a: compressed_loss(compressed_attention, *a, interpret=True),
        argnums=(0, 1, 2)))(q, k_cmp, v_cmp)
    f32 = [x.astype(jnp.float32) for x in (q, k_cmp, v_cmp)]
    ref_grad = jax.jit(jax.grad(lambda *a: compressed_loss(compressed_attention_reference, *a),
                                argnums=(0, 1, 2)))(*f32)
    for got, want in zip(kernel_grad, ref_grad):
        assert rel_err(got, want) <= BF16_TOL

    _, lse = jax.jit(functools.partial(compressed_attention_reference, **geometry))(*f32)
    selection = dict(geometry, sel_block=CFG.sel_block, n_sel=CFG.n_sel, n_init=CFG.n_init,
                     n_local=CFG.n_local)
    block_idx = jax.jit(functools.partial(select_blocks, **selection, interpret=True))(
        *f32[:2], lse)
    want_idx = jax.jit(functools.partial(select_blocks_reference, **selection))(*f32[:2], lse)
    assert float(jnp.mean(block_idx == want_idx)) >= 0.99   # near-ties may flip

    k, v = _normal(rng, B, T, G, d_k), _normal(rng, B, T, G, d_v)
    idx = random_block_idx(jax.random.PRNGKey(1), B, T, G, CFG.n_sel, CFG.sel_block)

    def selected_loss(fn, q, k, v, **kw):
        return jnp.sum(fn(q, k, v, idx, CFG.sel_block, **kw).astype(jnp.float32) ** 2)

    got = jax.jit(jax.grad(lambda *a: selected_loss(selected_attention, *a, interpret=True),
                           argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: selected_loss(selected_attention_reference, *a),
                            argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= BF16_TOL


# ----------------------------------------------------------------------------------------------
# A shape without tiles falls through to XLA


def test_heads_without_tiles_fall_through_to_xla(monkeypatch):
    monkeypatch.setenv("NSA_PROFILE", "sm89")
    rng = np.random.default_rng(2)
    cfg = CFG.replace(d_k=320, d_v=320)
    q = _normal(rng, 1, 40, 4, 320, dtype=jnp.float32)
    k_cmp = _normal(rng, 1, 9, 2, 320, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="no sm89 tiles"):
        compressed_attention(q, k_cmp, k_cmp, cmp_block=8, cmp_stride=4, interpret=True)
    o = dispatch.call("compressed_attention", "pallas", q, k_cmp, k_cmp, cfg, scale=0.1,
                      return_lse=False)
    want = dispatch.call("compressed_attention", "xla", q, k_cmp, k_cmp, cfg, scale=0.1,
                         return_lse=False)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
    # The Pallas backend declines (the reason dispatch reports), and "pallas" runs XLA there.
    with pytest.raises(NotImplementedError, match="select kernel has no sm89 tiles"):
        pallas_backend.select_blocks(q, k_cmp, cfg, scale=0.1,
                                     lse=jnp.zeros(q.shape[:3], jnp.float32))
    monkeypatch.setenv("NSA_PROFILE", "sm90")   # sm90 serves every width, as before
    assert compressed_attention(q, k_cmp, k_cmp, cmp_block=8, cmp_stride=4,
                                interpret=True)[0].shape == (1, 40, 4, 320)


# ----------------------------------------------------------------------------------------------
# Compiled for sm80 / sm89: shared memory within the limit, spills small

_ROWS = {}


def _compile(kernels: str, archs: str, heads: str, tmp_path) -> list[dict]:
    path = tmp_path / "rows.csv"
    proc = subprocess.run([sys.executable, SCRIPT, kernels, "--arch", archs, "--heads", heads,
                           "--S", "1024", "--csv", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return list(csv.DictReader(open(path)))


def _check(rows, expected_kernels: int):
    assert len(rows) >= expected_kernels
    for row in rows:
        label = f"{row['arch']} d_k {row['d_k']} d_v {row['d_v']} {row['kernel']}"
        assert row["status"] == "ok", label
        assert int(row["shared_bytes"]) <= int(row["shared_limit"]), label
        assert row["fits"] == "True", label
        # Every kernel stays within a few hundred bytes of spill stores on these tiles.
        assert int(row["spill_stores"]) <= 256, (label, row["spill_stores"])


def _needs_triton():
    pytest.importorskip("triton")


def test_paper_heads_fit_sm89(tmp_path):
    """The kernels that overflowed or spilled on sm89 with sm90's tiles, at the paper's heads:
    compressed attention (forward over 101,376 B, dq 163,840 B, dk/dv 8.5 KB of spills) and
    selected attention (dk/dv spills)."""
    _needs_triton()
    rows = _compile("compressed", "sm89", "192/128", tmp_path)
    _check(rows, 3)
    assert {r["kernel"] for r in rows} == {"nsa_compressed_attention_fwd",
                                           "nsa_compressed_attention_dq",
                                           "nsa_compressed_attention_dkv"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm80", "sm89"])
def test_every_kernel_fits(arch, tmp_path):
    """Every kernel (prefill, backward, decode) at d_k 128, 192, 256 and d_k != d_v."""
    _needs_triton()
    rows = _compile("all", arch, "128/128,192/128,256/256,128/256", tmp_path)
    _check(rows, 4 * 21)   # 21 kernels a head size (the decode step: 7)


# ----------------------------------------------------------------------------------------------
# Which path runs the window and compressed branches of backend "pallas"
#
# On a CPU the fused paths never open (no GPU), so each is replaced by a recorder: cuDNN's gate
# opens for bfloat16 up to the profile's head-size limit, FA-3 is "installed", and the calls
# are recorded at the last step of each path (FA-3's primitive, cuDNN's attention, the Pallas
# kernels' jitted call after every check of their wrappers). No recorder called: XLA's chunked
# path ran.

WINDOW_MODULE = importlib.import_module("pallas_kernels.window_attention")
COMPRESSED_MODULE = importlib.import_module("pallas_kernels.compressed_attention")


@pytest.fixture
def paths(monkeypatch):
    """The list each path appends its name to ("fa3", "cudnn", "pallas")."""
    from nsa_jax.xla import cudnn

    taken = []

    def fa3_forward(q, k, v, **kw):
        taken.append("fa3")
        B, S, N, _ = q.shape
        return jnp.zeros((B, S, N, v.shape[-1]), q.dtype), jnp.zeros((B, N, S), jnp.float32)

    def cudnn_attention(q, k, v, scale, *, window, residual, mla):
        taken.append("cudnn")
        o = jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)
        return (o, jnp.zeros(q.shape[:3], jnp.float32)) if residual else o

    def kernel(q, *args):
        taken.append("pallas")
        return jnp.zeros(q.shape[:3] + args[1].shape[-1:], q.dtype), jnp.zeros(q.shape[:3])

    monkeypatch.setattr(cudnn, "_fa3_ops", lambda: (fa3_forward, None))
    monkeypatch.setattr(cudnn, "takes", lambda q, k, v: (q.dtype == jnp.bfloat16
                                                         and q.shape[-1] <= cudnn.max_head_dim()))
    monkeypatch.setattr(cudnn, "_cudnn_attention", cudnn_attention)
    monkeypatch.setattr(WINDOW_MODULE, "_window_attention_jit", kernel)
    monkeypatch.setattr(COMPRESSED_MODULE, "_compressed_attention_jit", kernel)
    return taken


# cuDNN's own kernel off: the options `nsa_jax.sharding` gives the branches inside a `shard_map`
# over 2 devices where jax's cuDNN primitives cannot be bound below their custom_partitioning.
SHARD_MAP = {"xla": dataclasses.replace(sharding.XLA_DEFAULTS, cudnn_kernel=False),
             "pallas": pallas_backend.PallasOptions(cudnn_kernel=False)}


# profile, head dims, options; the path of both branches with `window_kernel` on; the window's
# path by default, which is backend "xla"'s (None: its chunked path, no recorder called).
ROUTES = ("profile, d_k, d_v, options, path, xla_window", [
    ("sm90", 128, 128, None, "fa3", "fa3"),
    ("sm90", 128, 128, SHARD_MAP, "fa3", "fa3"),      # FA-3 stays preferred where it serves
    ("sm90", 192, 128, None, "cudnn", "cudnn"),       # FA-3 takes heads up to 128
    ("sm90", 192, 128, SHARD_MAP, "pallas", None),
    # by default the window follows options["xla"], whose fa3 is on
    ("sm90", 128, 128, {"pallas": pallas_backend.PallasOptions(fa3=False)}, "cudnn", "fa3"),
    ("sm90", 128, 128, {"pallas": pallas_backend.PallasOptions(window_cudnn=False,
                                                               compressed_cudnn=False)},
     "pallas", "fa3"),
    ("sm89", 128, 128, None, "cudnn", "cudnn"),       # FA-3 installed, never chosen off sm90
    ("sm89", 128, 128, SHARD_MAP, "pallas", None),
    ("sm89", 192, 128, None, "pallas", None),         # cuDNN takes heads up to 128 off sm90
    ("sm86", 64, 64, SHARD_MAP, "pallas", None),
    ("sm80", 192, 128, None, "pallas", None),
    ("sm80", 128, 128, None, "cudnn", "cudnn"),
])


def _compiled(options, **pallas):
    """`options` with the Pallas kernels compiled (not interpreted) and `pallas` set."""
    options = {"pallas": pallas_backend.PallasOptions(), **(options or {})}
    options["pallas"] = dataclasses.replace(options["pallas"], interpret=False, **pallas)
    return options


def _routing_inputs(d_k, d_v):
    rng = np.random.default_rng(3)
    q = _normal(rng, 1, 32, 4, d_k)
    return q, _normal(rng, 1, 32, 2, d_k), _normal(rng, 1, 32, 2, d_v)


def _window(backend, q, k, v, **kw):
    """`sliding_window_attention` through dispatch on `backend`, jitted: one compilation
    instead of one an operation (the routing is decided while tracing, as eagerly)."""
    return jax.jit(lambda q, k, v: dispatch.call("sliding_window_attention", backend, q, k, v,
                                                 **kw))(q, k, v)


def _compressed(q, k, v, options):
    cfg = CFG.replace(d_k=q.shape[-1], d_v=v.shape[-1])
    jax.jit(lambda q, k, v: dispatch.call("compressed_attention", "pallas", q, k, v, cfg,
                                          scale=0.1, return_lse=True, options=options))(
        q, k[:, :7], v[:, :7])


@pytest.mark.parametrize(*ROUTES)
def test_fused_branches_choose_fa3_cudnn_or_the_kernel(monkeypatch, paths, profile, d_k, d_v,
                                                       options, path, xla_window):
    """With `window_kernel` on, the window takes the compressed branch's path."""
    del xla_window
    monkeypatch.setenv("NSA_PROFILE", profile)
    options = _compiled(options, window_kernel=True)
    q, k, v = _routing_inputs(d_k, d_v)
    _window("pallas", q, k, v, window=8, scale=0.1, options=options)
    _compressed(q, k, v, options)
    assert paths == [path, path]


@pytest.mark.parametrize(*ROUTES)
def test_window_kernel_on_by_default_on_a_gpu(monkeypatch, paths, profile, d_k, d_v, options,
                                              path, xla_window):
    """`window_kernel` None (default), kernels compiled: the window takes the compressed
    branch's path, as with `window_kernel=True`."""
    del xla_window
    monkeypatch.setenv("NSA_PROFILE", profile)
    options = _compiled(options)
    assert options["pallas"].window_kernel is None
    q, k, v = _routing_inputs(d_k, d_v)
    _window("pallas", q, k, v, window=8, scale=0.1, options=options)
    _compressed(q, k, v, options)
    assert paths == [path, path]


def test_window_kernel_off_in_interpret_mode_by_default():
    options = pallas_backend.PallasOptions(interpret=True)
    assert not options.resolve_window_kernel()
    assert pallas_backend.PallasOptions(interpret=False).resolve_window_kernel()
    assert pallas_backend.PallasOptions(interpret=True, window_kernel=True).resolve_window_kernel()
    with pytest.raises(ValueError, match="window_kernel"):
        pallas_backend.PallasOptions(window_kernel=1)


@pytest.mark.parametrize(*ROUTES)
def test_window_runs_on_xla_with_the_kernel_off(monkeypatch, paths, profile, d_k, d_v, options,
                                                path, xla_window):
    """`window_kernel=False`: the adapter declines, naming the option, and backend "xla" runs
    the window as it does alone (same path, same bits); the window kernel is never called, and
    the compressed branch's path is unchanged."""
    monkeypatch.setenv("NSA_PROFILE", profile)
    options = _compiled(options, window_kernel=False)
    q, k, v = _routing_inputs(d_k, d_v)
    with pytest.raises(NotImplementedError, match="window_kernel"):
        pallas_backend.sliding_window_attention(q, k, v, window=8, scale=0.1,
                                                options=options["pallas"])
    o = _window("pallas", q, k, v, window=8, scale=0.1, options=options)
    want = _window("xla", q, k, v, window=8, scale=0.1, options=options)
    _compressed(q, k, v, options)
    window_paths = [xla_window, xla_window] if xla_window else []   # backend "pallas", "xla"
    assert paths == window_paths + [path]
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("why, profile, d_k, dtype, packed", [
    ("no sm89 tiles", "sm89", 320, jnp.bfloat16, False),
    ("no sm90 tiles", "sm90", 320, jnp.bfloat16, False),   # cuDNN's limit is 256 there
    ("float64", "sm90", 64, jnp.float64, False),
    ("packed sequences", "sm90", 64, jnp.bfloat16, True),
])
def test_window_falls_through_to_xla_with_a_reason(monkeypatch, paths, why, profile, d_k,
                                                  dtype, packed):
    """With `window_kernel` on, the Pallas adapter declines (NotImplementedError, its reason)
    or, for packed sequences, is never asked (registered packed=False): the banded XLA path
    runs, exactly."""
    from nsa_jax.segments import from_cu_seqlens

    monkeypatch.setenv("NSA_PROFILE", profile)
    options = _compiled(None, window_kernel=True)
    rng = np.random.default_rng(4)
    with enable_x64() if dtype == jnp.float64 else contextlib.nullcontext():
        q = _normal(rng, 1, 24, 4, d_k, dtype=dtype)
        k, v = _normal(rng, 1, 24, 2, d_k, dtype=dtype), _normal(rng, 1, 24, 2, d_k, dtype=dtype)
        segments = from_cu_seqlens(jnp.array([0, 10, 24], jnp.int32), 24, CFG) if packed else None
        if not packed:
            with pytest.raises(NotImplementedError, match=why):
                pallas_backend.sliding_window_attention(q, k, v, window=5, scale=0.1,
                                                        options=options["pallas"])
        o = _window("pallas", q, k, v, window=5, scale=0.1, segments=segments, options=options)
        want = _window("xla", q, k, v, window=5, scale=0.1, segments=segments)
        assert o.dtype == dtype
    assert paths == []
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
