"""`NSAConfig`: the single source of truth for the spec's hyperparameters (docs/NSA_SPEC.md)."""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

COMPRESS_MODES = ("mlp", "mean")


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """Hyperparameters of one NSA layer. Frozen and hashable: usable as a `jax.jit` static argument.

    Field names follow the spec: `n_heads` is H, `n_kv_heads` is G, `cmp_block` is l,
    `cmp_stride` is d, `sel_block` is l_sel, `window` is w.
    """

    d_model: int = 256
    n_heads: int = 8
    n_kv_heads: int = 2
    d_k: int = 32
    d_v: int = 32
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    n_sel: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    compress: Literal["mlp", "mean"] = "mlp"
    shared_kv: bool = False
    rope_theta: Optional[float] = 10000.0

    def __post_init__(self) -> None:
        positive = ("d_model", "n_heads", "n_kv_heads", "d_k", "d_v", "cmp_block", "cmp_stride",
                    "sel_block", "n_sel", "window")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} ({value}) must be positive")
        for name in ("n_init", "n_local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} ({value!r}) must be a non-negative int")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.cmp_block % self.cmp_stride:
            raise ValueError(f"cmp_stride ({self.cmp_stride}) must divide cmp_block "
                             f"({self.cmp_block})")
        if self.sel_block % self.cmp_stride:
            raise ValueError(f"cmp_stride ({self.cmp_stride}) must divide sel_block "
                             f"({self.sel_block})")
        if self.cmp_block > self.sel_block:
            raise ValueError(f"cmp_block ({self.cmp_block}) must be <= sel_block "
                             f"({self.sel_block})")
        if self.n_sel < self.n_init + self.n_local:
            raise ValueError(f"n_sel ({self.n_sel}) must be >= n_init + n_local "
                             f"({self.n_init + self.n_local})")
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"compress ({self.compress!r}) must be one of {COMPRESS_MODES}")
        if not isinstance(self.shared_kv, bool):
            raise ValueError(f"shared_kv ({self.shared_kv!r}) must be a bool")
        if self.rope_theta is not None:
            if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)):
                raise ValueError(f"rope_theta ({self.rope_theta!r}) must be a float or None")
            if not self.rope_theta > 0:
                raise ValueError(f"rope_theta ({self.rope_theta}) must be positive")
            if self.d_k % 2:
                raise ValueError(f"d_k ({self.d_k}) must be even when rope_theta is set")

    # Derived quantities -------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        """h = H // G: query heads sharing one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def scale(self) -> float:
        """The default softmax scale 1/sqrt(d_k)."""
        return 1.0 / math.sqrt(self.d_k)

    def replace(self, **changes) -> "NSAConfig":
        return dataclasses.replace(self, **changes)

    # Presets ------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **changes) -> "NSAConfig":
        """A CPU-test size with the paper's ratios (l = 2d, l_sel = 4d) and d_k != d_v."""
        base = cls(d_model=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=8, cmp_block=8, cmp_stride=4,
                   sel_block=16, n_sel=4, n_init=1, n_local=2, window=16)
        return base.replace(**changes)

    @classmethod
    def paper(cls, **changes) -> "NSAConfig":
        """The paper's 27B-model attention: H 64, G 4, d_k 192, d_v 128, l 32, d 16, l_sel 64,
        n_sel 16, w 512, hidden size 2560."""
        base = cls(d_model=2560, n_heads=64, n_kv_heads=4, d_k=192, d_v=128, cmp_block=32,
                   cmp_stride=16, sel_block=64, n_sel=16, n_init=1, n_local=2, window=512)
        return base.replace(**changes)

    @classmethod
    def preset(cls, name: str, **changes) -> "NSAConfig":
        presets = {"tiny": cls.tiny, "paper": cls.paper}
        if name not in presets:
            raise ValueError(f"preset ({name!r}) must be one of {sorted(presets)}")
        return presets[name](**changes)
