"""`NSAConfig`: one class for both frameworks, its presets and its validation errors."""
import dataclasses

import pytest

import nsa_torch_ref
from nsa_common import NSAConfig


def test_torch_reexports_the_common_config():
    assert nsa_torch_ref.NSAConfig is NSAConfig


def test_defaults_are_the_papers_hyperparameters():
    cfg = NSAConfig()
    assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_sel, cfg.n_init, cfg.n_local,
            cfg.window) == (32, 16, 64, 16, 1, 2, 512)
    assert cfg.compress == "mlp" and cfg.shared_kv is False and cfg.rope_theta == 10000.0


def test_presets():
    paper = NSAConfig.paper()
    assert (paper.n_heads, paper.n_kv_heads, paper.d_k, paper.d_v) == (64, 4, 192, 128)
    assert (paper.cmp_block, paper.cmp_stride, paper.sel_block, paper.n_sel, paper.window) == \
        (32, 16, 64, 16, 512)
    tiny = NSAConfig.tiny()
    assert tiny.d_k != tiny.d_v and tiny.n_heads > tiny.n_kv_heads
    # tiny keeps the paper's ratios l = 2d, l_sel = 4d.
    assert tiny.cmp_block == 2 * tiny.cmp_stride and tiny.sel_block == 4 * tiny.cmp_stride
    assert NSAConfig.preset("tiny", window=8) == tiny.replace(window=8)
    assert NSAConfig.preset("paper") == paper
    with pytest.raises(ValueError, match="preset"):
        NSAConfig.preset("huge")


def test_frozen_hashable_and_derived():
    cfg = NSAConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3
    assert hash(cfg) == hash(NSAConfig.tiny()) and cfg == NSAConfig.tiny()
    assert len({cfg, NSAConfig.tiny(), NSAConfig.paper()}) == 2
    assert cfg.heads_per_group == cfg.n_heads // cfg.n_kv_heads
    assert cfg.scale == pytest.approx(cfg.d_k ** -0.5)


def test_zero_forced_blocks_are_allowed():
    cfg = NSAConfig.tiny(n_init=0, n_local=0, n_sel=1)
    assert cfg.n_init == 0 and cfg.n_local == 0


POSITIVE = ["d_model", "n_heads", "n_kv_heads", "d_k", "d_v", "cmp_block", "cmp_stride",
            "sel_block", "n_sel", "window"]


@pytest.mark.parametrize("field", POSITIVE)
@pytest.mark.parametrize("value", [0, -2])
def test_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError, match=rf"^{field} \({value}\) must be positive"):
        NSAConfig.tiny(**{field: value})


@pytest.mark.parametrize("field", POSITIVE + ["n_init", "n_local"])
@pytest.mark.parametrize("value", [2.0, True, "4"])
def test_sizes_must_be_ints(field, value):
    with pytest.raises(ValueError, match=rf"^{field}"):
        NSAConfig.tiny(**{field: value})


@pytest.mark.parametrize("field", ["n_init", "n_local"])
def test_forced_counts_must_be_non_negative(field):
    with pytest.raises(ValueError, match=rf"^{field} \(-1\)"):
        NSAConfig.tiny(**{field: -1})


@pytest.mark.parametrize("changes, field", [
    (dict(n_heads=6, n_kv_heads=4), "n_heads"),                       # H % G
    (dict(cmp_block=10, cmp_stride=4, sel_block=16), "cmp_stride"),   # d | l
    (dict(cmp_block=8, cmp_stride=4, sel_block=18), "cmp_stride"),    # d | l_sel
    (dict(cmp_block=32, cmp_stride=4, sel_block=16), "cmp_block"),    # l <= l_sel
    (dict(n_sel=2, n_init=1, n_local=2), "n_sel"),                    # n_sel >= n_init + n_local
    (dict(compress="max"), "compress"),
    (dict(shared_kv=1), "shared_kv"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_theta="10000"), "rope_theta"),
    (dict(d_k=15), "d_k"),                                            # RoPE needs an even d_k
])
def test_constraint_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        NSAConfig.tiny(**changes)


def test_odd_d_k_is_fine_without_rope():
    assert NSAConfig.tiny(d_k=15, rope_theta=None).d_k == 15


def test_constraint_messages_carry_the_values():
    with pytest.raises(ValueError, match=r"n_sel \(2\) must be >= n_init \+ n_local \(3\)"):
        NSAConfig.tiny(n_sel=2, n_init=1, n_local=2)
    with pytest.raises(ValueError, match=r"cmp_stride \(4\) must divide cmp_block \(10\)"):
        NSAConfig.tiny(cmp_block=10, sel_block=16)
