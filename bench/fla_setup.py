"""fla-org's NSA as the benches run it: its configuration in NSAConfig's terms, its shape bound,
and the window shim that runs its `parallel_nsa` without the flash_attn package. Shared by
bench_prefill.py (the `*_fla` and `fla_parallel_nsa` rows) and fla_agreement.py (the check that
those rows compute the same function)."""
from __future__ import annotations

from typing import Any

# fla's parallel_nsa needs h = H/G a power of two of at least this.
FLA_MIN_HEADS_PER_GROUP = 16


def fla_fields(sel_block: int) -> dict[str, Any]:
    """The NSAConfig fields of fla-org's configuration: mean compression with l = d = l_sel,
    shared k/v."""
    return dict(compress="mean", cmp_block=sel_block, cmp_stride=sel_block, shared_kv=True)


def fla_config(cfg):
    """fla-org's configuration of `cfg` (`fla_fields`)."""
    return cfg.replace(**fla_fields(cfg.sel_block))


def install_window_shim(fla_parallel) -> str:
    """fla's window branch calls the flash_attn package; where it is missing, give it
    nsa_torch_ref.fast.fa2's sliding window (the same causal mask: window_size = (w - 1, 0) is
    keys t - w + 1 .. t). Returns a label of the window's implementation."""
    if fla_parallel.flash_attn_func is not None:
        return "flash_attn"
    from nsa_torch_ref.fast.fa2 import sliding_window_attention_fa2

    def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
        if not causal or window_size[1] != 0 or window_size[0] < 0:
            raise ValueError("this shim serves fla's causal sliding window only")
        return sliding_window_attention_fa2(q, k, v, window_size[0] + 1)

    fla_parallel.flash_attn_func = flash_attn_func
    return "torch FA-2 via nsa_torch_ref.fast.fa2"
