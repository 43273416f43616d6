"""Conventions shared by the Pallas GPU kernels of this package.

Kept small on purpose: the Triton-lowering constraints every kernel here pads to, the one
matrix product (`dot`) and its precision policy, the one masked-score constant, the one way to
launch a Triton `pallas_call` (compiler parameters under either jax name, and the filter for jax
0.11's deprecation warning of the Triton lowering), and the checks of the wrappers' knobs.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Triton's `tl.dot` needs every matrix dimension >= 16, and every tensor dimension a power of 2.
MATMUL_MIN = 16
# The narrowest column part of a product in the backward kernels over (query, head) rows. At 16
# the compressed dK/dV kernel's bf16 products returned a wrong dK on an H200 (rel. error
# 0.17-0.27 against the reference; dQ and dV right, float32 right, the interpreter right); from
# 32 on they agree. Only tiny test configs have heads this narrow.
MIN_PART = 2 * MATMUL_MIN

# The exact text jax 0.11 warns with (a DeprecationWarning) when it lowers a Triton pallas_call.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version\.")

# Values of `implementation=` a kernel wrapper accepts. "xla" is the plain-JAX reference, so a
# dispatch point can fall through to it; a Mosaic GPU variant would add "mosaic_gpu" here.
IMPLEMENTATIONS = ("triton", "xla")

# Input dtypes of the kernels: their accumulators, softmax statistics and residuals are float32.
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

# A finite "minus infinity" for masked scores: exp2(MASK - m) underflows to exactly 0 for any real
# running max m, and MASK - MASK stays finite, so no mask pattern can produce inf - inf = NaN.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def matmul_dim(n: int) -> int:
    """A tensor dimension that may enter `tl.dot`: a power of two, at least `MATMUL_MIN`."""
    return max(MATMUL_MIN, next_pow2(n))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """`x` padded at the end of `axis` up to `size` (no copy when it already has that size)."""
    extra = size - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of size {x.shape[axis]} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def column_parts(d: int, split: bool = True) -> tuple:
    """(offset, width) column parts of a `d`-wide operand that enter `tl.dot`, each a power of
    two >= MATMUL_MIN: `d` itself, or its two binary parts where `split` and `d` is the sum of
    two such powers (192 = 128 + 64, 96 = 64 + 32), else `d` padded to one part. Split, the
    products read and multiply `d` columns instead of the padded power of two (a quarter less
    at 192)."""
    if d == matmul_dim(d):
        return ((0, d),)
    high = next_pow2(d) // 2
    if split and d - high == next_pow2(d - high) and d - high >= MATMUL_MIN:
        return ((0, high), (high, d - high))
    return ((0, matmul_dim(d)),)


def key_parts(d: int, split: bool = True, narrowest: int = MIN_PART) -> tuple:
    """`column_parts(d, split)` with no part narrower than `narrowest` (>= `MIN_PART`), else one
    part, `d` padded to a power of two >= `MIN_PART`: 192 -> 128 + 64, 96 -> 64 + 32 (128 for
    `narrowest` 64), 48 -> 64."""
    parts = column_parts(max(d, MIN_PART), split)
    if min(width for _, width in parts) < max(narrowest, MIN_PART):
        parts = column_parts(max(d, MIN_PART), split=False)
    return parts


def parts_width(parts: tuple) -> int:
    """The width of the array the column parts cover (the padded width of one part)."""
    offset, width = parts[-1]
    return offset + width


def load_cols(ref, index: tuple, parts: tuple) -> list:
    """`ref[index]` cut into the column parts (index: the leading indexers; empty: every row of
    a 2-D ref); one load when one part spans the ref, the same load as without parts."""
    if len(parts) == 1:
        return [ref[index + (slice(None),)] if index else ref[...]]
    index = index or (pl.ds(0, ref.shape[0]),)
    return [ref[index + (pl.ds(o, w),)] for o, w in parts]


def load_head_rows(ref, rows, parts: tuple) -> list:
    """Rows `[queries * h_pad, width]` of the queries `rows` (a `pl.ds`, or `slice(None)`: all)
    of a `[.., h_pad, d]` ref (row r: query r // h_pad, head r % h_pad), one array a column
    part; one load when one part spans the ref."""
    if len(parts) == 1 and parts[0][1] == ref.shape[2]:
        tile = ref[rows, :, :]
        return [tile.reshape(tile.shape[0] * tile.shape[1], ref.shape[2])]
    out = []
    for offset, width in parts:
        tile = ref[rows, :, pl.ds(offset, width)]
        out.append(tile.reshape(tile.shape[0] * tile.shape[1], width))
    return out


def store_head_rows(ref, values: list, parts: tuple) -> None:
    """Inverse of `load_head_rows` for a whole `[q_tile, h_pad, d]` block."""
    q_tile, h_pad = ref.shape[:2]
    if len(parts) == 1 and parts[0][1] == ref.shape[2]:
        ref[...] = values[0].reshape(ref.shape).astype(ref.dtype)
        return
    for (offset, width), value in zip(parts, values):
        ref[:, :, pl.ds(offset, width)] = value.reshape(q_tile, h_pad, width).astype(ref.dtype)


def store_cols(ref, values: list, parts: tuple, index: tuple = ()) -> None:
    """ref[index + (part,)] = value for each column part (`values` as `load_cols` gives; index:
    the leading indexers; empty: every row of a 2-D ref)."""
    if len(parts) == 1:
        if index:
            ref[index + (slice(None),)] = values[0]
        else:
            ref[...] = values[0]
        return
    index = index or (slice(None),)
    for (o, w), value in zip(parts, values):
        ref[index + (pl.ds(o, w),)] = value


def dot_parts(a_parts: list, b_parts: list, dot_fn=None):
    """sum over the column parts of `a_p @ b_p^T` (float32): the product of the whole rows."""
    dot_fn = dot_fn or dot
    s = dot_fn(a_parts[0], b_parts[0], trans_b=True)
    for a, b in zip(a_parts[1:], b_parts[1:]):
        s = s + dot_fn(a, b, trans_b=True)
    return s


def triton_compiler_params(num_warps: int, num_stages: int):
    """`CompilerParams` of the Pallas Triton lowering under its current name (jax >= 0.7), or
    its older name `TritonCompilerParams`."""
    from jax.experimental.pallas import triton as pltriton
    params = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
    return params(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False, highest_16bit: bool = True):
    """`a @ b` of two 2-D tiles (operands optionally transposed), accumulated in float32.

    Precision policy: float32 operands multiply at `Precision.HIGHEST`, i.e. in IEEE float32 on
    Triton (its default would be TF32, ~1e-3 relative error, outside the spec's float32
    tolerance); 16-bit operands multiply on the matrix units in their own precision.

    `highest_16bit` only picks how a 16-bit product is tagged in the lowered `tt.dot`: True
    (HIGHEST, no input-precision tag) as compressed_attention, select_blocks and decode were
    measured with; False (the default precision, a TF32 tag, which Triton reads only for float32
    operands) as selected_attention was. Each kernel keeps the lowering its GPU runs verified.
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    highest = highest_16bit or a.dtype == jnp.float32
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST if highest else None,
                           preferred_element_type=jnp.float32)


def pallas_call(kernel, *, name: str, num_warps: int, num_stages: int, interpret: bool,
                **kwargs):
    """`pl.pallas_call` for the Triton lowering: compiler parameters from `num_warps` and
    `num_stages`, and (outside the interpreter) the deprecation filter installed before the call
    is lowered. `kwargs`: grid, specs, out_shape, debug, ... as `pl.pallas_call` takes them."""
    if not interpret:
        silence_triton_deprecation()
    return pl.pallas_call(kernel, name=name, interpret=interpret,
                          compiler_params=triton_compiler_params(num_warps, num_stages),
                          **kwargs)


def online_softmax_init(rows: int, dv: int):
    """The carry `(acc [rows, dv], running max [rows], running sum [rows])` (float32) of an online
    softmax over scores in the log2 domain with masked scores at `MASK`: no key seen yet."""
    return (jnp.zeros((rows, dv), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry, s, v, dot_fn=None):
    """One online-softmax update with scores `s [rows, n]` in the log2 domain, masked keys at
    `MASK`, values `v [n, dv]`; `dot_fn` the product `p @ v` (default `dot`). A masked key
    weighs `2^(MASK - m) = 0` once the row has seen a key; before that its row's max is still
    `MASK` and the sums it adds are wiped by the correction `2^(MASK - m) = 0` at the row's first
    key, or the row is empty and `online_softmax_finish` gives o = 0. The compressed-attention
    kernels keep their own loop: they mask with -inf and can skip V (lse only)."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + (dot_fn or dot)(p.astype(v.dtype), v)
    return acc, m_new, l


def online_softmax_finish(carry):
    """(o, lse in log2) of an online softmax; a row that saw no key (its max still the mask)
    gets o = 0, lse = -inf."""
    acc, m, l = carry
    empty = m < 0.5 * MASK
    l_safe = jnp.where(empty, 1.0, l)
    o = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None])
    return o, jnp.where(empty, -jnp.inf, m + jnp.log2(l_safe))


@functools.cache
def silence_triton_deprecation() -> None:
    """Ignore jax 0.11's warning that the Pallas Triton lowering is deprecated: that message only,
    as a DeprecationWarning only, installed once when a kernel is first built for the GPU.

    The warning fires when a pallas_call is lowered, which under an outer `jax.jit` happens when
    that jit compiles, after the kernel wrapper has returned. A `catch_warnings` block around the
    wrapper cannot see it, so the filter lasts for the process; a process that never builds a
    Triton kernel never installs it."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def check_tile_sizes(block_sizes) -> None:
    """Validate a kernel's frozen `BlockSizes` dataclass: every field a positive int, and every
    `block*` field (a tile dimension) a power of two >= `MATMUL_MIN`."""
    import dataclasses

    for field in dataclasses.fields(block_sizes):
        value = getattr(block_sizes, field.name)
        if field.type in (bool, "bool"):  # a variant switch, not a size
            if not isinstance(value, bool):
                raise ValueError(f"block_sizes.{field.name} ({value!r}) must be a bool")
            continue
        if field.type in (str, "str"):  # a named variant: its dataclass checks the name
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"block_sizes.{field.name} ({value!r}) must be a positive int")
        if field.name.startswith("block") and (value < MATMUL_MIN or value != next_pow2(value)):
            raise ValueError(f"block_sizes.{field.name} ({value}) must be a power of 2 >= "
                             f"{MATMUL_MIN}")


def softmax_scale(scale, d_k: int) -> float:
    """The softmax scale of a kernel call: `1 / sqrt(d_k)` for None, else `scale` as a float;
    ValueError for anything but a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(d_k)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale ({scale!r}) must be a finite float or None")
    return float(scale)


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation ({implementation!r}) must be one of {IMPLEMENTATIONS}")


def check_kernel_dtype(kernel: str, dtype) -> None:
    """NotImplementedError (not ValueError) for a dtype outside `KERNEL_DTYPES`, e.g. float64: a
    dispatch fallback list then moves on to a backend that takes it (XLA computes float64)."""
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        raise NotImplementedError(
            f"the Pallas {kernel} kernel takes {', '.join(map(str, KERNEL_DTYPES))} inputs "
            f"(float32 accumulators), got {jnp.dtype(dtype)}")
