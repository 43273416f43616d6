"""Block sizes of every Pallas kernel per GPU architecture: one table, one lookup.

A kernel called with `block_sizes=None` takes its tiles from here, for the architecture of the
device the call is traced on, its input dtype and its head sizes:

    NSA_PROFILE (sm80 | sm86 | sm89 | sm90)  >  the device's compute capability  >  sm90

`NSA_PROFILE=base` (the PyTorch reference's name for "no profile") and an unset variable both
mean the device's own capability; a CPU (interpret mode) takes sm90's tiles, so CPU tests run
the tiles an H100 runs. Forcing a profile makes every choice of that architecture on any GPU
(`NSA_PROFILE=sm89` on an H100 runs what an RTX 4090 runs, FlashAttention-3 off included).

Each architecture's entry lists, per kernel, tiers `(head width, block sizes)`: the first tier
whose width holds the call's head width, `d_k + d_v` with each padded to a power of two (the
selection has no values: `2 * d_k`; the compressed kernels count d_k 192 as 192, the width they
read it at), serves it; 512 holds every head up to d_k = d_v = 256. A call wider than every
tier of its architecture raises `NotImplementedError`, which
`nsa_jax.dispatch` reads as "this backend declines" and falls through to the next backend (XLA):
no kernel is ever launched with tiles over the device's shared memory.

sm90 (H100 / H200) holds the tiles the kernels were tuned with (bench/RESULTS.md). The others
are chosen so that every kernel at d_k, d_v up to 256 fits the architecture's shared memory per
block and keeps its spill stores small, as compiled by `scripts/pallas_ptxas.py --arch`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax.numpy as jnp

from pallas_kernels._common import matmul_dim
from pallas_kernels.compressed_attention import BlockSizes as CompressedBlockSizes
from pallas_kernels.compressed_attention import (
    FLOAT32_BLOCK_SIZES as FLOAT32_COMPRESSED_BLOCK_SIZES)
from pallas_kernels.compressed_attention import key_width as compressed_key_width
from pallas_kernels.decode import DecodeBlockSizes
from pallas_kernels.select_blocks import BlockSizes as SelectBlockSizes
from pallas_kernels.selected_attention import BlockSizes as SelectedBlockSizes
from pallas_kernels.window_attention import BlockSizes as WindowBlockSizes
from pallas_kernels.window_attention import FLOAT32_BLOCK_SIZES as FLOAT32_WINDOW_BLOCK_SIZES

ENV = "NSA_PROFILE"
# Accepted for NSA_PROFILE with the meaning "the device decides" (the PyTorch profile name).
DEVICE_PROFILE = "base"
DEFAULT_ARCH = "sm90"
KERNELS = ("compressed", "select", "selected", "decode", "window")


@dataclasses.dataclass(frozen=True)
class ArchProfile:
    """What the kernels and the Pallas backend assume of one GPU architecture.

    shared_memory: bytes of shared memory one block may use (the opt-in maximum).
    fa3: FlashAttention-3 (Hopper only) may run the compressed branch's fused path.
    cudnn_max_head_dim: the widest head cuDNN's fused attention takes there.
    tiers: kernel name -> dtype class ("16bit" | "float32") -> ((widest head, sizes), ...).
    """

    name: str
    shared_memory: int
    fa3: bool
    cudnn_max_head_dim: int
    tiers: dict = dataclasses.field(compare=False, hash=False)

    def block_sizes(self, kernel: str, dtype, d_k: int, d_v: Optional[int] = None):
        """The block sizes of `kernel` for inputs of `dtype` with these head dims (`d_v` None:
        the kernel reads no values); raises NotImplementedError where no tier of this
        architecture is wide enough."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")
        head_dims = (d_k,) if d_v is None else (d_k, d_v)
        # The compressed kernels read a d_k of two column parts (192) at its own width; the
        # tiers hold heads up to 256 (320 = 256 + 64 counts as 512 and declines).
        dk_width = matmul_dim(d_k)
        if kernel == "compressed" and d_k <= 256:
            dk_width = compressed_key_width(d_k)
        width = dk_width + matmul_dim(d_k if d_v is None else d_v)
        by_dtype = self.tiers[kernel]
        tiers = by_dtype.get(_dtype_class(dtype)) or by_dtype["16bit"]
        for widest, sizes in tiers:
            if width <= widest:
                return sizes
        raise NotImplementedError(
            f"the Pallas {kernel} kernel has no {self.name} tiles for head dims {head_dims} "
            f"(d_k + d_v at most {tiers[-1][0]} on {self.name}, {self.shared_memory:,} B of "
            f"shared memory per block)")


def _dtype_class(dtype) -> str:
    return "float32" if jnp.dtype(dtype).itemsize >= 4 else "16bit"


# ----------------------------------------------------------------------------------------------
# The tables

# Any head width: sm90 keeps the kernels' behaviour at every width.
_ANY = 1 << 30

# sm90: the tiles the kernels were tuned with on an H100 / H200, unchanged, except for the one
# kernel those overflow: the compressed dq kernel at d_k = d_v = 256 (262,144 B), which takes
# half the query rows there (196,608 B, no spills).
_SM90 = {
    "compressed": {"16bit": ((384, CompressedBlockSizes()),
                             (_ANY, CompressedBlockSizes(block_q_dq=64))),
                   "float32": ((_ANY, FLOAT32_COMPRESSED_BLOCK_SIZES),)},
    "select": {"16bit": ((_ANY, SelectBlockSizes()),)},
    # Heads up to 128: tiles of 4 queries stacked where their union holds at most 32 blocks,
    # else one query a program (on an H200, the selected kernel 9-12% / 8% faster forward /
    # forward+backward at 8k and 64k on a trained model's fitted selection, the core on random
    # ones within 3%; bench/RESULTS.md, Selection workloads); `selected_attention` takes fewer
    # tokens a tile where the group's heads fill more than 64 rows. Wider heads and float32: one
    # query a program (not timed stacked).
    "selected": {"16bit": ((256, SelectedBlockSizes(tokens_fwd=4, tokens_dq=4,
                                                    stack_tokens=True, stack_max_union=32,
                                                    num_warps_stack=4)),
                           (_ANY, SelectedBlockSizes())),
                 "float32": ((_ANY, SelectedBlockSizes()),)},
    "decode": {"16bit": ((_ANY, DecodeBlockSizes()),)},
    # Sliding window: the defaults up to d 128 with dk/dv from transposed scores (the
    # transposed-operand form at 64 x 64 tiles, 8 warps, 2 stages returned a wrong bf16 dk on
    # an H100, relative error 0.14-0.19 at d 64-128, while any other tile or form agreed); at
    # d_k 192 half the dk/dv rows (64 spilled 692 B); at 256 half the forward and dq rows (dq:
    # 262,144 B otherwise) and 32-key dk/dv tiles from transposed scores (the other forms
    # spilled 1.7-3.7 KB). Wider heads were never compiled: they decline (cuDNN or XLA runs
    # them).
    "window": {"16bit": ((256, WindowBlockSizes(dkv_transposed=True)),
                         (384, WindowBlockSizes(block_q_dkv=32)),
                         (512, WindowBlockSizes(block_q=64, block_q_dq=64, block_kv_dkv=32,
                                                dkv_transposed=True))),
               "float32": ((256, FLOAT32_WINDOW_BLOCK_SIZES),
                           (512, dataclasses.replace(FLOAT32_WINDOW_BLOCK_SIZES,
                                                     block_q_dq=32)))},
}

# sm86 / sm89 (101,376 B a block) and sm80 (166,912 B): Ampere and Ada have no wgmma, so the
# operands of every product pass through registers and shared memory, and sm90's tiles spill or
# overflow there (compressed forward: 1,412 B of spill stores at d 128, 147,456 B of shared
# memory at d 256). These tiles keep every kernel inside 101,376 B up to d_k = d_v = 256 with at
# most 68 B of spill stores, except the selection's 604-864 B, whose spill-free tilings were
# slower under the sm89 profile on an H100 (`scripts/pallas_ptxas.py all --arch sm89`,
# bench/RESULTS.md); sm80 takes the same tiles (its larger shared memory is not needed for the
# fit). Some were timed on an H100 under the sm89 profile (bench/RESULTS.md), none on these GPUs.
_COMPRESSED_AMPERE_128 = CompressedBlockSizes(
    block_q=128, block_kv=32, block_q_dq=64, block_kv_dq=32, block_q_dkv=32, block_kv_dkv=32,
    num_warps=8, num_warps_bwd=8, num_stages=2, dkv_transposed=True)
# d_k 192 (two column parts, 128 + 64) with d_v <= 128: from five tilings that fit sm89, timed
# under the sm89 profile on an H100 at 32k, paper heads (bench/RESULTS.md), the fastest
# forward's (128-row query and 64-key tiles) and the fastest backward's (128-row query tiles for
# dK/dV): 60.4 against 98.4 ms forward+backward for the wide-head tiles below. At most 68 B of
# spill stores (forward, sm80).
_COMPRESSED_AMPERE_192 = dataclasses.replace(_COMPRESSED_AMPERE_128, block_kv=64,
                                             block_q_dkv=128)
# Wide heads: a quarter of the query rows (a [64, 256] q tile is 32 KiB of shared memory).
_COMPRESSED_AMPERE_256 = dataclasses.replace(_COMPRESSED_AMPERE_128, block_q=64, block_kv_dq=16)
# Sliding window: 4 warps and 64-row query tiles; wide heads take half the rows and 8 warps in
# the backward (4 warps: 900-1,068 B of dk/dv spills at d 256). No spills up to 256.
_WINDOW_AMPERE_128 = WindowBlockSizes(
    block_q=64, block_kv=32, block_q_dq=64, block_kv_dq=32, block_q_dkv=32, block_kv_dkv=32,
    num_warps=4, num_warps_bwd=4, num_stages=2, dkv_transposed=True)
_WINDOW_AMPERE_256 = dataclasses.replace(_WINDOW_AMPERE_128, block_q=32, block_q_dq=32,
                                         num_warps_bwd=8)
_AMPERE = {
    # dkv_transposed: the plain `a @ b` products spill nothing where the transposed-operand
    # ones spilled 944-4,892 B (8 warps, d 128-256).
    "compressed": {"16bit": ((256, _COMPRESSED_AMPERE_128), (320, _COMPRESSED_AMPERE_192),
                             (512, _COMPRESSED_AMPERE_256)),
                   "float32": ((256, dataclasses.replace(_COMPRESSED_AMPERE_128, num_stages=1)),
                               (512, dataclasses.replace(_COMPRESSED_AMPERE_256, num_stages=1,
                                                         block_kv=16)))},
    # 64 queries a program at d_k 192 spilled 476 B; 32 queries and 2 stages spill <= 64 B.
    "select": {"16bit": ((256, SelectBlockSizes()),
                         (512, SelectBlockSizes(block_queries=32, num_stages=2)))},
    # The dk/dv kernel holds a selection block's K, V and their float32 gradients: 32 gathered
    # rows a step at d 128; 16 rows, 8 warps and no pipelining at d 256 (64 rows, 4 warps:
    # 1,964 B of spills and 140,032 B of shared memory).
    "selected": {"16bit": ((256, SelectedBlockSizes(dkv_rows=32)),
                           (512, SelectedBlockSizes(dkv_rows=16, num_warps_dkv=8,
                                                    num_stages_dkv=1,
                                                    num_warps_dkv_reduce=8)))},
    "decode": {"16bit": ((512, DecodeBlockSizes()),)},
    "window": {"16bit": ((256, _WINDOW_AMPERE_128), (512, _WINDOW_AMPERE_256)),
               "float32": ((256, dataclasses.replace(_WINDOW_AMPERE_128, num_stages=1)),
                           (512, dataclasses.replace(_WINDOW_AMPERE_256, num_stages=1,
                                                     block_q_dq=16, block_kv_dq=16,
                                                     block_q_dkv=16, block_kv_dkv=16)))},
}
_SM89 = _AMPERE
_SM80 = _AMPERE

PROFILES: dict[str, ArchProfile] = {
    "sm80": ArchProfile("sm80", shared_memory=166_912, fa3=False, cudnn_max_head_dim=128,
                        tiers=_SM80),
    "sm86": ArchProfile("sm86", shared_memory=101_376, fa3=False, cudnn_max_head_dim=128,
                        tiers=_SM89),
    "sm89": ArchProfile("sm89", shared_memory=101_376, fa3=False, cudnn_max_head_dim=128,
                        tiers=_SM89),
    "sm90": ArchProfile("sm90", shared_memory=232_448, fa3=True, cudnn_max_head_dim=256,
                        tiers=_SM90),
}

# compute capability (major, minor) -> profile; a major not listed takes the profile of the
# nearest listed capability below it.
_CAPABILITIES = {(8, 0): "sm80", (8, 6): "sm86", (8, 7): "sm86", (8, 9): "sm89",
                 (9, 0): "sm90", (12, 0): "sm89"}


def names() -> tuple[str, ...]:
    """The profile names NSA_PROFILE takes (besides "base")."""
    return tuple(sorted(PROFILES))


def profile_for_capability(capability) -> str:
    """The profile of a compute capability `"8.9"` / `(8, 9)`: the listed one at or below it."""
    if isinstance(capability, str):
        capability = tuple(int(part) for part in capability.split(".")[:2])
    capability = tuple(capability)
    below = [cap for cap in _CAPABILITIES if cap <= capability]
    if not below:
        return "sm86"   # pre-Ampere: the smallest shared memory of the table
    return _CAPABILITIES[max(below)]


def device_capability() -> Optional[str]:
    """The compute capability ("9.0") of JAX's first device, None off a GPU."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "gpu":
        return None
    return str(getattr(device, "compute_capability", "") or "") or None


def resolve() -> tuple[str, str]:
    """(profile name, why): NSA_PROFILE, else the device's capability, else sm90 (a CPU)."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen and chosen != DEVICE_PROFILE:
        if chosen not in PROFILES:
            raise ValueError(f"{ENV} ({chosen!r}) must be one of "
                             f"{[DEVICE_PROFILE, *names()]}")
        return chosen, f"{ENV}={chosen} (env)"
    capability = device_capability()
    if capability is None:
        return DEFAULT_ARCH, "no GPU (interpret mode takes sm90's tiles)"
    return profile_for_capability(capability), f"compute capability {capability}"


def current() -> ArchProfile:
    """The profile of this trace (see `resolve`)."""
    return PROFILES[resolve()[0]]


def block_sizes(kernel: str, dtype, d_k: int, d_v: Optional[int] = None):
    """`current().block_sizes(...)`: the default tiles of `kernel` here."""
    return current().block_sizes(kernel, dtype, d_k, d_v)
