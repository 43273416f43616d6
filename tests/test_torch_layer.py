"""`NSAAttention` against the brute-force layer, its gradients, packing, validation and dispatch."""
import copy
import functools
import math

import numpy as np
import pytest
import torch

import bruteforce
from nsa_common import NSAConfig
from nsa_common.testing import rel_err as _rel_err
from nsa_torch_ref import NSAAttention, dispatch, reference

RTOL = 1e-10  # relative error allowed against the float64 brute force

# A zero reference (an exactly zero output or gradient) is compared by its absolute error.
rel_err = functools.partial(_rel_err, absolute_if_zero=True)


def make_layer(cfg: NSAConfig, seed: int = 0, **kwargs) -> NSAAttention:
    """A float64 layer whose biases and position embeddings are non-zero too, so a bias or an
    embedding applied wrongly shows up."""
    torch.manual_seed(seed)
    layer = NSAAttention(cfg, **kwargs).double()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.startswith(("bg", "cmp_k.b", "cmp_v.b")):
                param.normal_(0, 0.5)
    return layer


def bf_layer(layer: NSAAttention, x: torch.Tensor, cu_seqlens=None):
    params = {name: p.detach().numpy() for name, p in layer.state_dict().items()}
    return bruteforce.bf_nsa_layer(params, x.numpy(), layer.cfg,
                                   None if cu_seqlens is None else cu_seqlens.tolist())


def random_x(cfg: NSAConfig, B: int, T: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, cfg.d_model, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------
def test_parameter_names_and_shapes_follow_design():
    cfg = NSAConfig.tiny()
    D, H, G, dk, dv, l = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v, cfg.cmp_block
    expected = {"wq": (D, H * dk), "wg": (D, H * 3), "bg": (H * 3,), "wo": (H * dv, D)}
    for branch in ("cmp", "sel", "win"):
        expected[f"wk.{branch}"] = (D, G * dk)
        expected[f"wv.{branch}"] = (D, G * dv)
    for name, dim in (("cmp_k", dk), ("cmp_v", dv)):
        expected.update({f"{name}.pos": (G, l, dim), f"{name}.w1": (G, l * dim, dim),
                         f"{name}.b1": (G, dim), f"{name}.w2": (G, dim, dim),
                         f"{name}.b2": (G, dim)})
    shapes = {name: tuple(t.shape) for name, t in NSAAttention(cfg).state_dict().items()}
    assert shapes == expected

    shared_mean = NSAAttention(cfg.replace(shared_kv=True, compress="mean")).state_dict()
    assert sorted(shared_mean) == ["bg", "wg", "wk.shared", "wo", "wq", "wv.shared"]


def test_initialisation_scales():
    cfg = NSAConfig.tiny(d_model=256)
    torch.manual_seed(0)
    layer = NSAAttention(cfg)
    assert abs(layer.wq.std().item() - 1 / math.sqrt(cfg.d_model)) < 0.1 / math.sqrt(cfg.d_model)
    assert abs(layer.cmp_k["pos"].std().item() - 0.02) < 0.005
    assert abs(layer.cmp_k["w1"].std().item() - 1 / math.sqrt(cfg.cmp_block * cfg.d_k)) < 0.01
    for bias in (layer.bg, layer.cmp_k["b1"], layer.cmp_v["b2"]):
        assert torch.all(bias == 0)


# ---------------------------------------------------------------------------------------------
# Forward against the brute force
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", ["mlp", "mean"])
@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("rope_theta", [10000.0, None])
def test_layer_matches_bruteforce(compress, shared_kv, rope_theta):
    cfg = NSAConfig.tiny(compress=compress, shared_kv=shared_kv, rope_theta=rope_theta)
    layer = make_layer(cfg)
    x = random_x(cfg, 2, 45)
    y, aux = layer(x, return_aux=True)
    y_ref, aux_ref = bf_layer(layer, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, y_ref) <= RTOL
    np.testing.assert_array_equal(aux["block_idx"].numpy(), aux_ref["block_idx"])
    assert aux["block_idx"].dtype == torch.int32
    for name in ("o_cmp", "o_sel", "o_win", "gates"):
        assert aux[name].shape == aux_ref[name].shape
        assert rel_err(aux[name], aux_ref[name]) <= RTOL, name


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 1), (4, 4), (16, 1)])
@pytest.mark.parametrize("T", [5, 12, 70])
def test_layer_matches_bruteforce_groups_and_lengths(n_heads, n_kv_heads, T):
    """Other GQA shapes, and T < l (empty compressed branch), T < l_sel, several blocks."""
    cfg = NSAConfig.tiny(n_heads=n_heads, n_kv_heads=n_kv_heads, window=10)
    layer = make_layer(cfg, seed=T)
    x = random_x(cfg, 1, T, seed=T)
    y, aux = layer(x, return_aux=True)
    y_ref, aux_ref = bf_layer(layer, x)
    assert rel_err(y, y_ref) <= RTOL
    np.testing.assert_array_equal(aux["block_idx"].numpy(), aux_ref["block_idx"])


def test_layer_float32_matches_float64():
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    x = random_x(cfg, 2, 45)
    y64, aux64 = layer(x, return_aux=True)
    y32, aux32 = layer.float()(x.float(), return_aux=True)
    assert y32.dtype == torch.float32
    assert torch.equal(aux32["block_idx"], aux64["block_idx"])
    assert rel_err(y32.double(), y64.detach().numpy()) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [3, 7, 8, 30])
@pytest.mark.parametrize("compress", ["mlp", "mean"])
def test_gradients_finite_for_every_parameter_and_input(T, compress):
    """T < l (no compressed block at all), T = l - 1, T = l and several blocks: every parameter
    and x get a finite gradient (zero where a branch is empty, never None or NaN)."""
    cfg = NSAConfig.tiny(compress=compress)
    layer = make_layer(cfg)
    x = random_x(cfg, 2, T).requires_grad_()
    y = layer(x)
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, param in layer.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    if T < cfg.cmp_block:
        # The compressed branch is empty: its projections and MLP cannot matter.
        assert torch.all(layer.wk["cmp"].grad == 0) and torch.all(layer.wv["cmp"].grad == 0)


def test_gradcheck_whole_layer():
    """Finite differences through the whole layer in float64, every parameter and the input.
    T = 20 covers rows without compressed blocks, three selection blocks and a full window."""
    cfg = NSAConfig(d_model=6, n_heads=2, n_kv_heads=1, d_k=4, d_v=2, cmp_block=4, cmp_stride=2,
                    sel_block=8, n_sel=3, n_init=1, n_local=1, window=6)
    layer = make_layer(cfg, seed=3)
    x = random_x(cfg, 1, 20, seed=4).requires_grad_()
    names = [name for name, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]

    def run(x, *flat_params):
        return torch.func.functional_call(layer, dict(zip(names, flat_params)), (x,))

    assert torch.autograd.gradcheck(run, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------
def test_packed_equals_separate_and_bruteforce():
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    lengths = [23, 6, 41]  # 6 < l: an empty compressed branch inside a pack
    x = random_x(cfg, 1, sum(lengths))
    cu_seqlens = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    y, aux = layer(x, cu_seqlens=cu_seqlens, return_aux=True)
    start = 0
    for n in lengths:
        y_alone, aux_alone = layer(x[:, start:start + n], return_aux=True)
        torch.testing.assert_close(y[:, start:start + n], y_alone, rtol=0, atol=1e-12)
        assert torch.equal(aux["block_idx"][:, start:start + n], aux_alone["block_idx"])
        start += n
    y_ref, aux_ref = bf_layer(layer, x, cu_seqlens)
    assert rel_err(y, y_ref) <= RTOL
    np.testing.assert_array_equal(aux["block_idx"].numpy(), aux_ref["block_idx"])
    assert rel_err(layer(x), y_ref) > 1e-3  # packing matters: unpacked differs


def test_packed_allows_empty_sequences():
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    x = random_x(cfg, 1, 30)
    y = layer(x, cu_seqlens=torch.tensor([0, 0, 12, 12, 30], dtype=torch.int32))
    y_two = layer(x, cu_seqlens=torch.tensor([0, 12, 30], dtype=torch.int32))
    torch.testing.assert_close(y, y_two, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def test_forward_rejects_bad_inputs():
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg)
    x = random_x(cfg, 1, 10)
    cases = [
        ((x[0],), {}, "x must be"),
        ((x[..., :-1],), {}, "x must be"),
        ((x[:, :0],), {}, "x must hold"),
        ((x,), dict(cu_seqlens=torch.tensor([0, 10])), "cu_seqlens must be an int32"),
        ((x,), dict(cu_seqlens=[0, 10]), "cu_seqlens must be an int32"),
        ((x,), dict(cu_seqlens=torch.tensor([[0, 10]], dtype=torch.int32)),
         "cu_seqlens must be 1-D"),
        ((x,), dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "non-decreasing"),
        ((x,), dict(cu_seqlens=torch.tensor([0, 9], dtype=torch.int32)), "end at T"),
        ((x,), dict(cu_seqlens=torch.tensor([1, 10], dtype=torch.int32)), "start at 0"),
        ((x.expand(2, -1, -1),), dict(cu_seqlens=torch.tensor([0, 10], dtype=torch.int32)),
         "batch size 1"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(*args, **kwargs)
    with pytest.raises(ValueError, match="cfg"):
        NSAAttention({"d_model": 64})


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def scratch_dispatch(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(dispatch, "_TABLE", copy.deepcopy(dispatch._TABLE))


def test_dispatch_defaults_and_unknown_names():
    for entry in dispatch.ENTRIES:
        assert "sdpa" in dispatch.available(entry)
    assert dispatch.resolve("selected_attention", "sdpa") is reference.selected_attention
    assert dispatch.resolve("select_blocks", "sdpa") is reference.select_blocks
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*known backends: \[.*'sdpa'"):
        dispatch.resolve("selected_attention", "nope")
    with pytest.raises(ValueError, match="branch"):
        dispatch.resolve("selection", "sdpa")
    with pytest.raises(ValueError, match="nope"):
        NSAAttention(NSAConfig.tiny(), backends={"sliding_window_attention": "nope"})
    with pytest.raises(ValueError, match="unknown branches"):
        NSAAttention(NSAConfig.tiny(), backends={"window": "sdpa"})


def test_layer_calls_registered_backends(scratch_dispatch):
    calls = []

    def recording(branch):
        default = dispatch.resolve(branch, "sdpa")

        def backend(*args, **kwargs):
            calls.append(branch)
            return default(*args, **kwargs)
        return backend

    for branch in dispatch.BRANCHES:
        dispatch.register(branch, "recording", recording(branch))
    cfg = NSAConfig.tiny()
    layer = make_layer(cfg, backends={branch: "recording" for branch in dispatch.BRANCHES})
    plain = make_layer(cfg)
    x = random_x(cfg, 1, 30)
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)
    assert sorted(calls) == sorted(dispatch.BRANCHES)

    # A backend that returns something else changes the output: the layer really uses it.
    dispatch.register("sliding_window_attention", "zeros",
                      lambda q, k, v, window, scale=None: torch.zeros_like(q[..., : v.shape[-1]]))
    _, aux = make_layer(cfg, backends={"sliding_window_attention": "zeros"})(x, return_aux=True)
    assert torch.all(aux["o_win"] == 0)
