"""Runtime options of the XLA backend, in one place with their defaults."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class XlaOptions:
    """Query-chunk sizes and toggles of the `"xla"` implementations.

    Every branch walks the queries in chunks of this many rows (`lax.map`, rematerialised in the
    backward pass), so no `[T, T]` mask and no `[T, H, T]` score tensor ever exists. Peak memory
    per chunk (float32 scores):
      - compressed attention / selection: `[B, q_chunk, H, C]` with `C ~ T / d`;
      - selected attention: the gathered keys and values `[B, q_chunk, G, n_sel * l_sel, d]`;
      - sliding window: `[B, q_chunk, H, q_chunk + w - 1]`.

    `window_cudnn`: on a GPU, hand the window branch to `jax.nn.dot_product_attention(...,
    implementation="cudnn", local_window_size=(w - 1, 0))` when cuDNN can take the shapes
    (bf16 / fp16, d_v <= d_k, no packed sequences); otherwise the chunked banded path runs.
    `compressed_cudnn`: the same for the compressed branch, as cuDNN's causal attention over
    the queries folded in chunks of `d` (`nsa_jax.xla.cudnn`); its lse carries no gradient.
    `fa3`: where one of those two cuDNN paths would run and `flash_attn3_jax` is installed on a
    Hopper or later GPU, FlashAttention-3 runs it instead (the same result; faster on an H200,
    bench/RESULTS.md). Nothing changes where the package is absent.
    `cudnn_kernel`: cuDNN's own kernel may run those paths where FA-3 does not (off: only
    FA-3 runs them, else the chunked paths). `nsa_jax.sharding` turns it off inside a
    `shard_map` over several devices only where jax's cuDNN primitives cannot be bound below
    their `custom_partitioning` (`cudnn.unpartitioned_ready`; through it XLA's compile of the
    gradient segfaults there).
    """

    compressed_q_chunk: int = 128
    select_q_chunk: int = 128
    selected_q_chunk: int = 64
    window_q_chunk: int = 128
    window_cudnn: bool = True
    compressed_cudnn: bool = True
    fa3: bool = True
    cudnn_kernel: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("q_chunk") and (isinstance(value, bool)
                                                    or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{field.name} ({value!r}) must be a positive int")


DEFAULT_OPTIONS = XlaOptions()
