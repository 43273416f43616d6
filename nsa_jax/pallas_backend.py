"""The `"pallas"` backend: adapters from the dispatch conventions to `pallas_kernels`.

The kernels take plain hyperparameters (`cmp_block=`, `sel_block=`, ...) and know nothing of
`NSAConfig`; this module is the only place where the two meet. Branches without a Pallas kernel
(`compress_kv`, `sliding_window_attention`) are not registered; `"pallas"` is registered with
`"xla"` as its fallback, so `backend="pallas"` (the same as `("pallas", "xla")`) runs them on
XLA. Packed sequences are not supported by the kernels (registered with `packed=False`): they
go to XLA too.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

import jax

from nsa_common import NSAConfig
# Module objects, not the same-named functions `pallas_kernels/__init__` re-exports.
cmp_kernel = importlib.import_module("pallas_kernels.compressed_attention")
select_kernel = importlib.import_module("pallas_kernels.select_blocks")
sel_kernel = importlib.import_module("pallas_kernels.selected_attention")
decode_kernel = importlib.import_module("pallas_kernels.decode")


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """Options of the `"pallas"` backend (pass as `options={"pallas": PallasOptions(...)}`).

    interpret: run the kernels in Pallas' interpreter; None (default) means "when JAX's default
    backend is not a GPU", so the same code runs, slowly but exactly, on a CPU.
    *_blocks: each kernel's tile sizes (None: the kernel's defaults, tuned on an H200);
    decode_blocks: those of `decode_step(..., backend="pallas")`.
    """

    interpret: Optional[bool] = None
    compressed_blocks: Optional[cmp_kernel.BlockSizes] = None
    select_blocks: Optional[select_kernel.BlockSizes] = None
    selected_blocks: Optional[sel_kernel.BlockSizes] = None
    decode_blocks: Optional[decode_kernel.DecodeBlockSizes] = None

    def resolve_interpret(self) -> bool:
        if self.interpret is not None:
            return self.interpret
        return jax.default_backend() != "gpu"


DEFAULT_OPTIONS = PallasOptions()


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, *, scale, return_lse,
                         options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    o, lse = cmp_kernel.compressed_attention(
        q, k_cmp, v_cmp, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, scale=scale,
        block_sizes=options.compressed_blocks, interpret=options.resolve_interpret())
    return (o, lse) if return_lse else o


def select_blocks(q, k_cmp, cfg: NSAConfig, *, scale, lse=None,
                  options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    if lse is None:  # kernel-level call without the compressed branch's statistics
        lse = cmp_kernel.compressed_lse(
            q, k_cmp, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, scale=scale,
            block_sizes=options.compressed_blocks, interpret=options.resolve_interpret())
    return select_kernel.select_blocks(
        q, k_cmp, lse, cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride,
        sel_block=cfg.sel_block, n_sel=cfg.n_sel, n_init=cfg.n_init, n_local=cfg.n_local,
        scale=scale, block_sizes=options.select_blocks, interpret=options.resolve_interpret())


def selected_attention(q, k, v, block_idx, *, block_size, scale,
                       options: Optional[PallasOptions] = None):
    options = options or DEFAULT_OPTIONS
    return sel_kernel.selected_attention(
        q, k, v, block_idx, block_size, scale, block_sizes=options.selected_blocks,
        interpret=options.resolve_interpret())


def register() -> None:
    """Register the three Pallas branches with `nsa_jax.dispatch` under the name "pallas", with
    "xla" for the rest."""
    from nsa_jax.dispatch import register_backend, register_fallback

    register_backend("compressed_attention", "pallas", compressed_attention)
    register_backend("select_blocks", "pallas", select_blocks)
    register_backend("selected_attention", "pallas", selected_attention)
    register_fallback("pallas", "xla")
