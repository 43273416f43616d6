"""Selection judged by what it should be: float64 block importance and the near-tie margin.

Where a framework's `block_idx` row differs from the float64 reference's, the row is classified
from the reference's own importance scores (spec step 6: p_slc after the GQA sum, forced blocks
at +inf, ineligible at -inf):

- **near-tie**: every block in the symmetric difference of the two sets scores within the margin
  of the reference's n-th best (the weakest block it keeps);
- **wrong**: otherwise (a block clearly better than the n-th best was dropped, or a clearly
  worse one taken, or a forced / ineligible block mishandled).

The margin is the error a correct implementation in the dtype makes on a score (docs/
NSA_SPEC.md, "Tolerances"). The logits z = scale q.k_cmp are computed from q and k_cmp rounded
to the dtype: each of the d_k products carries two roundings of relative size at most u (the
unit roundoff), independent from term to term, so they add in quadrature to
|dz| ~ 2 u scale |q| |k_cmp| / sqrt(d_k) =: 2 u Z. A softmax turns that into a relative error
of at most 2 |dz| = 4 u Z on each p_cmp, and the importance, a positive combination of p_cmp,
keeps that relative size. Two scores can move in opposite directions, so a swap needs
|s_i - s_n| <= 8 u Z max(s_i, s_n) =: the margin (`MARGIN_FACTOR` 8), with Z over the row's
heads and compressed blocks. On the GPU sweep (bfloat16, T 2048-8192) the flipped rows lie
within 0.02 margins of the n-th best: the bound holds with room, and a block off by more than
the margin is a fault, not rounding.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from nsa_common import NSAConfig, num_sel_blocks, overlap_weights
from nsa_torch_ref.reference import _compressed_rows, importance_scores

# Unit roundoff (half the spacing of 1.0) of each dtype.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8,
                 "float16": 2.0 ** -11}
MARGIN_FACTOR = 8.0


@dataclasses.dataclass(frozen=True)
class Importance:
    """Float64 block importance of every query row.

    score `[B, T, G, S]` (+inf forced, -inf ineligible) and z_scale `[B, T, G]` (the largest
    scale |q| |k_cmp| / sqrt(d_k): Z of the module docstring).
    """
    score: np.ndarray
    z_scale: np.ndarray


def importance(q: torch.Tensor, k_cmp: torch.Tensor, cfg: NSAConfig, *,
               scale: float | None = None, chunk: int = 256) -> Importance:
    """q `[B, T, H, d_k]`, k_cmp `[B, C, G, d_k]` (float64, as the reference computed them) ->
    the importance of every selection block for queries at positions 0..T-1."""
    B, T, H, d_k = q.shape
    C, G = k_cmp.shape[1], k_cmp.shape[2]
    scale = 1.0 / math.sqrt(d_k) if scale is None else scale
    S = num_sel_blocks(cfg, T)
    overlap = torch.from_numpy(overlap_weights(cfg, C, S)).to(q.device, torch.float64)
    k_norm = k_cmp.double().norm(dim=-1).amax(dim=1)                      # [B, G]
    q_norm = q.double().norm(dim=-1).reshape(B, T, G, H // G).amax(-1)    # [B, T, G]
    scores, z_scales = [], []
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        q_pos = torch.arange(start, stop, device=q.device)
        _, p_cmp, _ = _compressed_rows(q[:, start:stop].double(), k_cmp.double(), None, q_pos,
                                       cfg, scale)
        score = importance_scores(p_cmp, q_pos, cfg, S, overlap)         # [B, Tq, G, S]
        scores.append(score.cpu().numpy())
        z = scale * q_norm[:, start:stop] * k_norm[:, None] / math.sqrt(d_k)
        z_scales.append(z.cpu().numpy())
    return Importance(np.concatenate(scores, axis=1), np.concatenate(z_scales, axis=1))


@dataclasses.dataclass(frozen=True)
class SelectionVerdict:
    """Rows (b, t, g) of a block_idx compared with the reference: equal, near-tie, wrong."""
    rows: int
    equal: int
    near_tie: int
    wrong: int
    tie_mask: np.ndarray        # bool [B, T] query rows with a near-tie in any KV head
    wrong_mask: np.ndarray      # bool [B, T] query rows with a wrong selection in any KV head
    worst_gap: float            # largest |s_i - s_n| / margin over the differing blocks

    @property
    def passed(self) -> bool:
        return self.wrong == 0

    def describe(self) -> str:
        return (f"{self.equal} equal, {self.near_tie} near-tie, {self.wrong} wrong of "
                f"{self.rows} rows (worst gap {self.worst_gap:.2f} margins)")


def margin_for(dtype: str) -> float:
    """The relative margin per unit of Z: MARGIN_FACTOR * u (module docstring)."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype ({dtype!r}) must be one of {sorted(UNIT_ROUNDOFF)}")
    return MARGIN_FACTOR * UNIT_ROUNDOFF[dtype]


def _gap(score: np.ndarray, j: int, s_n: float, rel: float) -> float:
    """|s_j - s_n| in margins; infinite for an out-of-range, forced or ineligible block."""
    if not 0 <= j < score.shape[0] or not np.isfinite(score[j]) or not np.isfinite(s_n):
        return math.inf
    margin = rel * max(score[j], s_n)
    return abs(score[j] - s_n) / margin if margin > 0 else math.inf


def classify(block_idx: np.ndarray, reference_idx: np.ndarray, imp: Importance,
             dtype: str) -> SelectionVerdict:
    """block_idx, reference_idx int `[B, T, G, n_sel]` (-1 = none); imp over the same rows.

    A differing row is a near-tie when every block in the symmetric difference of the two sets
    scores within `margin_for(dtype) * Z * max(s_i, s_n)` of the reference's n-th best s_n (the
    lowest score it keeps); anything else (an ineligible block, a forced block dropped, a block
    clearly off) is wrong.
    """
    a, r = np.asarray(block_idx), np.asarray(reference_idx)
    if a.shape != r.shape:
        raise ValueError(f"block_idx shapes differ: {a.shape} vs {r.shape}")
    B, T, G, _ = a.shape
    rel = margin_for(dtype)
    differs = ~np.all(np.sort(a, -1) == np.sort(r, -1), axis=-1)         # [B, T, G]
    tie = np.zeros((B, T, G), bool)
    worst = 0.0
    for b, t, g in zip(*np.nonzero(differs)):
        chosen, kept = set(a[b, t, g][a[b, t, g] >= 0]), set(r[b, t, g][r[b, t, g] >= 0])
        score = imp.score[b, t, g]
        kept_scores = [score[j] for j in kept]
        s_n = min(kept_scores) if kept_scores else -math.inf
        gaps = [_gap(score, j, s_n, rel * imp.z_scale[b, t, g]) for j in chosen ^ kept]
        worst = max([worst] + gaps)
        tie[b, t, g] = max(gaps) <= 1.0
    wrong = differs & ~tie
    return SelectionVerdict(rows=int(differs.size), equal=int((~differs).sum()),
                            near_tie=int(tie.sum()), wrong=int(wrong.sum()),
                            tie_mask=tie.any(-1), wrong_mask=wrong.any(-1), worst_gap=worst)
