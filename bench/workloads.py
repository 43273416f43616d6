"""Selection workloads of the prefill and decode benches, and the overlap statistics that tell
them apart.

The selected branch's cost depends on which blocks the queries pick: a query tile whose queries
share blocks loads fewer distinct blocks than one whose queries pick independently. A workload
is a `block_idx int32 [B, T, G, n_sel]` (the core's form: per query and KV head, the selected
blocks in ascending order, -1 padded at the end) passed through the `block_idx=` argument of the
call a user makes, or none:

  random    no forcing: the selection the core computes from the bench's random inputs. Random
            queries and keys rank blocks independently, so neighbouring queries share little
            beyond the forced blocks (the worst case for the selected branch).
  coherent  `coherent_block_idx`: a synthetic selection in which query t + 1 keeps each of
            query t's freely chosen blocks with probability `keep` and redraws the others; the
            forced blocks (the first `n_init`, the `n_local` most recent eligible) are always
            chosen. `keep` follows from the target `overlap`, the mean share of query t's
            blocks that query t + 1 selects too (`keep_probability`). With `working_set` N,
            a replaced block is drawn from a working set of N blocks per (sequence, KV head)
            instead of from every eligible block, and each member of the set is swapped for a
            uniform eligible block with probability `drift` per query: queries then return to
            blocks their neighbours dropped, as a trained model's do, and a tile of queries
            selects fewer distinct blocks. `TRAINED_FIT` holds the values that reproduce a
            trained recall model's measured statistics at 8k.
  trained_fit
            coherent with `TRAINED_FIT`: the synthetic selection whose statistics match a
            trained recall model's measured ones (below).
  trained   a selection saved with `save_selection` (e.g. `layer_selection` of a trained
            layer's parameters on its inputs, or `examples/recall_benchmark.py
            --export_selection 8192`: a trained recall model's layers on one of its sequences,
            their KV groups side by side, with the benches' n_sel) and replayed from a `.npy`
            file.

A forced `block_idx` replaces the selection stage (`native_sparse_attention` skips
`select_blocks` when it is given), so a prefill row with a forced workload omits the selection's
time, which does not depend on the blocks chosen; the random workload's rows include it. A
decode step computes its selection either way (the compressed kernel ranks the blocks) and only
its selected attention reads the forced blocks.

Statistics (`overlap_stats`), over the queries of each KV head:
  jaccard      mean |S_t & S_t+1| / |S_t | S_t+1| of consecutive queries' block sets;
  shared       mean |S_t & S_t+1| / n_sel (what `coherent_block_idx`'s `overlap` targets);
  tile_union   mean number of distinct blocks selected by a tile of `tile` consecutive queries
               (64 by default): the blocks a kernel that walks the tile's union loads.

The statistics of a saved selection: `python bench/workloads.py --stats sel.npy`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKLOADS = ("random", "coherent", "trained_fit", "trained")
SYNTHETIC = ("coherent", "trained_fit")  # the workloads of coherent_block_idx
DEFAULT_OVERLAP = 0.8
DEFAULT_TILE = 64
# `--workload coherent` arguments whose statistics at T 8k (bench configuration: G 4, n_sel 16,
# l_sel 64) match the selection of a trained recall model (the alignment recipe's seed 2,
# exported at 8k with n_sel 16: shared 0.682, jaccard 0.633, 64-query tile union 44.3;
# bench/results/recall_benchmark_token_shift_h200/nsa_aligned_s2/selection_T8192.npy).
TRAINED_FIT = dict(overlap=0.695, working_set=36, drift=0.012)
# Below this many candidate blocks per free slot the generator draws row by row, from the list
# of candidates; above it, all rows at once, redrawing the rare clashes.
REJECTION_POOL_FACTOR = 4


# ---------------------------------------------------------------------------------------------
# The coherent generator
# ---------------------------------------------------------------------------------------------
def forced_count(cfg) -> int:
    """Blocks every query past the first n_sel blocks selects by rule: n_init + n_local."""
    return cfg.n_init + cfg.n_local


def overlap_range(cfg) -> tuple[float, float]:
    """(lowest, highest) `overlap` a coherent workload reaches: the forced blocks alone are
    shared (keep = 0), or every block is (keep = 1)."""
    return forced_count(cfg) / cfg.n_sel, 1.0


def keep_probability(cfg, overlap: float) -> float:
    """The chance that query t + 1 keeps each of query t's freely chosen blocks, for a mean
    shared share `overlap` of consecutive queries' blocks (past the first n_sel blocks, away
    from selection-block boundaries): overlap = (n_forced + keep * n_free) / n_sel."""
    low, high = overlap_range(cfg)
    if not low <= overlap <= high:
        raise ValueError(f"overlap ({overlap}) must lie in [{low:.4g}, 1]: the {forced_count(cfg)}"
                         f" forced blocks of n_sel {cfg.n_sel} are always shared")
    n_free = cfg.n_sel - forced_count(cfg)
    if n_free == 0:
        return 1.0
    return (overlap * cfg.n_sel - forced_count(cfg)) / n_free


def _redraw_rows(rng, lo: int, hi: int, old: np.ndarray, redraw: np.ndarray) -> np.ndarray:
    """`old` [C, m] (one query's free blocks per chain) with the slots where `redraw` [C, m] is
    set replaced by distinct values of [lo, hi] that the row does not keep, and none that the
    row held before when the range leaves room for that (so a redrawn slot takes a block the
    previous query did not select). For the first queries past the all-eligible phase, where
    the range is small."""
    chains, m = old.shape
    candidates = np.arange(lo, hi + 1)
    taken = old if hi - lo + 1 >= 2 * m else np.where(redraw, -1, old)
    excluded = (candidates[None, :, None] == taken[:, None, :]).any(-1)          # [C, P]
    keys = np.where(excluded, 2.0, rng.random((chains, candidates.size)))
    order = np.argsort(keys, axis=1)
    rank = np.maximum(np.cumsum(redraw, axis=1) - 1, 0)      # each redrawn slot's turn
    return np.where(redraw, candidates[np.take_along_axis(order, rank, axis=1)], old)


def _violations(free: np.ndarray, change: np.ndarray, avoid_old: np.ndarray, rows: np.ndarray,
                chunk: int = 8192) -> np.ndarray:
    """[len(rows), C, m]: at each of `rows` (indices >= 1 of free [n, C, m]), the slots that
    changed there and hold a value another slot of the row holds or (where `avoid_old` [n]) one
    the previous row held."""
    m = free.shape[2]
    others = ~np.eye(m, dtype=bool)
    bad = np.zeros((rows.size,) + free.shape[1:], bool)
    for lo in range(0, rows.size, chunk):
        r = rows[lo:lo + chunk]
        cur, prev = free[r], free[r - 1]
        clash = ((cur[..., :, None] == cur[..., None, :]) & others).any(-1)
        seen = (cur[..., :, None] == prev[..., None, :]).any(-1) & avoid_old[r, None, None]
        bad[lo:lo + chunk] = (clash | seen) & change[r]
    return bad


def _free_blocks(rng, cfg, chains: int, positions: np.ndarray, keep: float,
                 previous: Optional[np.ndarray]) -> np.ndarray:
    """The free blocks `[n, chains, n_free]` of the queries at `positions` (consecutive, all
    past the all-eligible phase), continuing from `previous` [chains, n_free] (the free blocks
    of the query before the first; None: a fresh draw). Each slot keeps its block with
    probability `keep`; a changed slot takes a block drawn uniformly from the eligible
    non-forced ones, redrawn while it clashes (`_violations`): all rows at once, then only the
    rows a redraw touched."""
    n_free = cfg.n_sel - cfg.n_init - cfg.n_local
    lo = cfg.n_init
    pool = positions // cfg.sel_block - cfg.n_local - lo + 1
    # Row 0 stands for the previous query (kept as it is), so row 1 follows the chain.
    pool = np.concatenate([pool[:1], pool])
    rows = pool.size
    change = rng.random((rows, chains, n_free)) >= keep
    change[0] = True
    if previous is None:
        change[1] = True

    def draw(mask):
        r = np.nonzero(mask)[0]
        return lo + (rng.random(r.size) * pool[r]).astype(np.int64)

    values = np.zeros((rows, chains, n_free), np.int64)
    values[change] = draw(change)
    if previous is not None:
        values[0] = previous
    last_change = np.maximum.accumulate(
        np.where(change, np.arange(rows)[:, None, None], 0), axis=0)
    avoid_old = pool >= 2 * n_free
    if previous is None:
        avoid_old[1] = False  # row 0 is a placeholder
    free = np.take_along_axis(values, last_change, axis=0)
    check = np.arange(1, rows)
    while check.size:
        bad = _violations(free, change, avoid_old, check)
        if not bad.any():
            break
        redrawn = np.zeros(values.shape, bool)
        redrawn[check] = bad
        values[redrawn] = draw(redrawn)
        # The rows whose slots hold a redrawn value, and the rows after them.
        touched = np.take_along_axis(redrawn, last_change, axis=0).any((1, 2))
        touched[1:] |= touched[:-1]
        check = np.nonzero(touched)[0]
        check = check[check >= 1]
        free[check] = np.take_along_axis(values, last_change[check], axis=0)
    return free[1:]


def _working_set_free(rng, cfg, chains: int, positions: np.ndarray, keep: float,
                      working_set: int, drift: float) -> np.ndarray:
    """The free blocks `[n, chains, n_free]` of the queries at `positions` (consecutive, all
    past the all-eligible phase), row by row: each slot keeps its block with probability
    `keep`; a changed slot takes a block of the chain's working set (`working_set` eligible
    non-forced blocks, each swapped for a uniform one with probability `drift` per query; the
    whole pool while it is no larger) that the previous query did not select, falling back to
    the other eligible blocks, then to the previous query's, when too few are left."""
    n_init, n_local = cfg.n_init, cfg.n_local
    n_free = cfg.n_sel - n_init - n_local
    out = np.zeros((positions.size, chains, n_free), np.int64)
    sets: list = [None] * chains
    previous: list = [None] * chains
    for r, t in enumerate(positions):
        hi = int(t) // cfg.sel_block - n_local             # the free candidates: n_init .. hi
        n_cand = hi - n_init + 1
        for c in range(chains):
            members = sets[c]
            if n_cand <= working_set:
                members = None
            elif members is None:
                members = [n_init + int(b) for b in rng.choice(n_cand, working_set,
                                                               replace=False)]
            else:
                present = set(members)
                for i in np.nonzero(rng.random(working_set) < drift)[0]:
                    b = n_init + int(rng.integers(n_cand))
                    while b in present:
                        b = n_init + int(rng.integers(n_cand))
                    present.discard(members[i])
                    present.add(b)
                    members[i] = b
            sets[c] = members
            candidates = range(n_init, hi + 1)
            pool = candidates if members is None else members
            prev = previous[c]
            held = set(prev) if prev is not None else set()
            slots = ([None] * n_free if prev is None else
                     [b if k else None for b, k in zip(prev, rng.random(n_free) < keep)])
            taken = {b for b in slots if b is not None}
            options = [int(b) for b in rng.permutation([b for b in pool if b not in held])]
            needed = slots.count(None)
            for extra in ([b for b in candidates if b not in held and b not in options],
                          sorted(held - taken)):
                if len(options) >= needed:
                    break
                options += [int(b) for b in rng.permutation(extra)]
            fill = iter(options)
            slots = [b if b is not None else next(fill) for b in slots]
            previous[c] = slots
            out[r, c] = slots
    return out


def coherent_block_idx(cfg, B: int, T: int, *, overlap: float = DEFAULT_OVERLAP, seed: int = 0,
                       start: int = 0, n_kv_heads: Optional[int] = None,
                       working_set: Optional[int] = None, drift: float = 0.0) -> np.ndarray:
    """A synthetic selection in which neighbouring queries share blocks: int32
    `[B, T - start, G, n_sel]`, the rows of positions `start .. T - 1`.

    Per (sequence, KV head), independently: while query t's eligible blocks (`0 .. t // l_sel`)
    number n_sel or fewer it selects them all, -1 padded (as the core does); past that it
    selects the first n_init blocks, the n_local most recent eligible ones, and n_free =
    n_sel - n_init - n_local free blocks among the others. Query t + 1 keeps each of query t's
    free blocks with probability `keep_probability(cfg, overlap)` and replaces the rest with
    eligible non-forced blocks that query t did not select, drawn uniformly, so the mean share
    of blocks consecutive queries share is `overlap` (the local blocks move at each
    selection-block boundary, once every l_sel queries, and just past the all-eligible phase
    the few candidates may repeat one). With `start` > 0 the chain begins at `start` with a
    fresh draw (the rows of decode steps at positions start, start + 1, ...). Causal, no
    duplicates, ascending. With `working_set`, replacements come from a drifting working set
    (`_working_set_free`; the module docstring), row by row.
    """
    G = cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
    if not 0 <= start < T:
        raise ValueError(f"start ({start}) must lie in [0, T = {T})")
    keep = keep_probability(cfg, overlap)
    rng = np.random.default_rng(seed)
    n_sel, l_sel, n_init, n_local = cfg.n_sel, cfg.sel_block, cfg.n_init, cfg.n_local
    n_free = n_sel - n_init - n_local
    if working_set is not None and working_set < 2 * n_free:
        raise ValueError(f"working_set ({working_set}) must be at least 2 x the {n_free} free "
                         "blocks a query selects (a replaced block avoids the previous query's)")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift ({drift}) must lie in [0, 1]")
    chains = B * G
    out = np.full((T - start, chains, n_sel), -1, np.int32)
    positions = np.arange(start, T)
    last = positions // l_sel
    # All eligible blocks selected.
    early = last < n_sel
    blocks = np.arange(n_sel)
    out[early] = np.where(blocks[None, :] <= last[early, None], blocks, -1)[:, None, :]
    free_rows = np.zeros((T - start, chains, n_free), np.int64)
    if working_set is not None:
        if (~early).any() and n_free:
            free_rows[~early] = _working_set_free(rng, cfg, chains, positions[~early], keep,
                                                  working_set, drift)
    else:
        # The first queries past that, where few blocks are free to choose: row by row.
        row_by_row = ~early & (last - n_local - n_init + 1 < REJECTION_POOL_FACTOR * n_free)
        previous = None
        for r in np.nonzero(row_by_row)[0]:
            lo, hi = n_init, last[r] - n_local
            if previous is None:
                previous = _redraw_rows(rng, lo, hi, np.full((chains, n_free), -1),
                                        np.ones((chains, n_free), bool))
            else:
                previous = _redraw_rows(rng, lo, hi, previous,
                                        rng.random((chains, n_free)) >= keep)
            free_rows[r] = previous
        # The rest, where a clash is rare: all at once.
        vectorized = ~early & ~row_by_row
        if vectorized.any() and n_free:
            free_rows[vectorized] = _free_blocks(rng, cfg, chains, positions[vectorized], keep,
                                                 previous)
    late = ~early
    if late.any():
        local = last[late, None] - np.arange(n_local)[None, ::-1]          # [n, n_local]
        rows = np.concatenate([np.broadcast_to(np.arange(n_init), (late.sum(), chains, n_init)),
                               free_rows[late],
                               np.broadcast_to(local[:, None, :], (late.sum(), chains, n_local))],
                              axis=-1)
        out[late] = np.sort(rows, axis=-1)
    return out.reshape(T - start, B, G, n_sel).transpose(1, 0, 2, 3).copy()


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def overlap_stats(block_idx, *, tile: int = DEFAULT_TILE, first: int = 0,
                  chunk: int = 4096) -> dict[str, float]:
    """Overlap of a selection `block_idx [B, T, G, n_sel]` (-1: no block), over the rows from
    `first` on: `jaccard` and `shared` (consecutive rows t, t + 1 of each sequence and KV head)
    and `tile_union` (distinct blocks of each tile of `tile` consecutive rows, the remainder
    left out), as the module docstring defines them; NaN where there are too few rows."""
    idx = np.asarray(block_idx)
    if idx.ndim != 4:
        raise ValueError(f"block_idx must be [B, T, G, n_sel], got shape {idx.shape}")
    idx = idx[:, first:]
    B, T, G, n_sel = idx.shape
    jaccard_sum = shared_sum = 0.0
    pairs = 0
    for lo in range(0, max(T - 1, 0), chunk):
        hi = min(T - 1, lo + chunk)
        a, b = idx[:, lo:hi], idx[:, lo + 1:hi + 1]
        inter = ((a[..., :, None] == b[..., None, :]) & (a >= 0)[..., :, None]).sum((-1, -2))
        union = (a >= 0).sum(-1) + (b >= 0).sum(-1) - inter
        jaccard_sum += float(np.where(union > 0, inter / np.maximum(union, 1), 1.0).sum())
        shared_sum += float(inter.sum()) / n_sel
        pairs += inter.size
    n_tiles = T // tile
    if n_tiles:
        tiles = idx[:, :n_tiles * tile].reshape(B, n_tiles, tile, G, n_sel)
        tiles = np.sort(tiles.transpose(0, 1, 3, 2, 4).reshape(B, n_tiles, G, tile * n_sel), -1)
        distinct = (tiles >= 0) & (np.diff(tiles, axis=-1, prepend=-1) != 0)
        tile_union = float(distinct.sum(-1).mean())
    else:
        tile_union = float("nan")
    nan = float("nan")
    return {"jaccard": jaccard_sum / pairs if pairs else nan,
            "shared": shared_sum / pairs if pairs else nan, "tile_union": tile_union}


def format_stats(stats: dict[str, float], tile: int = DEFAULT_TILE) -> str:
    """One line: `shared 0.812, jaccard 0.701, 64-query tile union 41.3 blocks` (a statistic
    that could not be computed, too few rows, is left out)."""
    parts = []
    for name, text in (("shared", "shared {:.3f}"), ("jaccard", "jaccard {:.3f}"),
                       ("tile_union", f"{tile}-query tile union {{:.1f}} blocks")):
        value = stats.get(name)
        if value is not None and value == value:  # not NaN
            parts.append(text.format(value))
    return ", ".join(parts) or "no statistics (too few rows)"


# ---------------------------------------------------------------------------------------------
# Selections a layer makes, saved and replayed
# ---------------------------------------------------------------------------------------------
def layer_selection(params, x, cfg, *, backend="xla") -> np.ndarray:
    """The blocks an NSA layer (`nsa_jax.nsa_attention`) with `params` selects on x
    `[B, T, d_model]`: int32 `[B, T, G, n_sel]` (its `aux["block_idx"]`)."""
    import jax
    import nsa_jax

    def select(params, x):
        return nsa_jax.nsa_attention(params, x, cfg, backend=backend, return_aux=True)[1][
            "block_idx"]

    return np.asarray(jax.jit(select)(params, x))


def core_selection(q, k, v, gates, cfg, *, cmp_params=None, gates_are_logits=True,
                   backend="xla") -> np.ndarray:
    """The blocks the attention core (`nsa_jax.native_sparse_attention`) selects on its inputs
    (k / v one array or a dict per branch, as the core takes them): int32 `[B, T, G, n_sel]`.
    Jitted so that only the selection's inputs are computed."""
    import jax
    import nsa_jax

    def select(q, k, v, gates, cmp_params):
        return nsa_jax.native_sparse_attention(
            q, k, v, gates, cfg, cmp_params=cmp_params, gates_are_logits=gates_are_logits,
            backend=backend, return_aux=True)[1]["block_idx"]

    return np.asarray(jax.jit(select)(q, k, v, gates, cmp_params or None))


def save_selection(path: str, block_idx) -> None:
    """Write a selection `[B, T, G, n_sel]` for the `trained` workload (`--workload-file`)."""
    idx = np.asarray(block_idx)
    if idx.ndim != 4 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"block_idx must be an int array [B, T, G, n_sel], got {idx.dtype} "
                         f"{idx.shape}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.save(path, idx.astype(np.int32))


def load_selection(path: str, cfg, *, n_kv_heads: Optional[int] = None) -> np.ndarray:
    """A saved selection, checked against cfg: int32 `[B, T, G, n_sel]`, each row causal
    (blocks <= t // l_sel), ascending and -1 padded."""
    idx = np.load(path)
    G = cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
    if idx.ndim != 4 or idx.shape[2:] != (G, cfg.n_sel):
        raise ValueError(f"{path}: shape {idx.shape}, expected [B, T, G = {G}, "
                         f"n_sel = {cfg.n_sel}]")
    check_selection(idx, cfg.sel_block, what=path)
    return idx.astype(np.int32)


def check_selection(block_idx, sel_block: int, *, what: str = "block_idx",
                    start: int = 0) -> None:
    """ValueError unless every row of `block_idx [B, T, G, n]` (row r at position start + r)
    holds blocks <= t // l_sel in ascending order, then only -1."""
    idx = np.asarray(block_idx)
    t = start + np.arange(idx.shape[1])[None, :, None, None]
    valid = idx >= 0
    if (idx[valid] < 0).any() or (np.where(valid, idx, 0) > t // sel_block).any():
        raise ValueError(f"{what}: a block lies after its query's own block")
    if (valid[..., 1:] & ~valid[..., :-1]).any():
        raise ValueError(f"{what}: -1 padding must come last in each row")
    both = valid[..., 1:] & valid[..., :-1]
    if (both & (idx[..., 1:] <= idx[..., :-1])).any():
        raise ValueError(f"{what}: each row's blocks must be ascending and distinct")


# ---------------------------------------------------------------------------------------------
# The benches' entry points
# ---------------------------------------------------------------------------------------------
def add_workload_args(parser) -> None:
    """--workload, --overlap, --workload-seed, --workload-file (one spelling in every bench)."""
    group = parser.add_argument_group("selection workload (bench/workloads.py)")
    group.add_argument("--workload", default="random", choices=WORKLOADS,
                       help="random: the core's own selection of random inputs; coherent: the "
                            "synthetic selection of --overlap; trained_fit: the synthetic "
                            "selection fitted to a trained model's (workloads.TRAINED_FIT); "
                            "trained: --workload-file")
    group.add_argument("--overlap", type=float, default=DEFAULT_OVERLAP,
                       help="coherent: mean share of blocks consecutive queries share")
    group.add_argument("--working-set", dest="working_set", type=int, default=None,
                       help="coherent: replaced blocks come from a drifting working set of this "
                            "many blocks per KV head (default: from every eligible block); "
                            "--overlap 0.695 --working-set 36 --drift 0.012 matches a trained "
                            "recall model's selection at 8k (workloads.TRAINED_FIT)")
    group.add_argument("--drift", type=float, default=0.0,
                       help="coherent with --working-set: chance per query that a member of "
                            "the working set is swapped for a uniform eligible block")
    group.add_argument("--workload-seed", dest="workload_seed", type=int, default=0)
    group.add_argument("--workload-file", dest="workload_file", default=None,
                       help="trained: a selection [B, T, G, n_sel] saved with save_selection")


def check_workload_args(args) -> None:
    if args.workload == "trained" and not args.workload_file:
        raise ValueError("--workload trained needs --workload-file (a .npy selection)")
    if args.workload != "coherent" and getattr(args, "working_set", None) is not None:
        raise ValueError("--working-set applies to --workload coherent only")
    if args.workload in SYNTHETIC:
        try:
            coherent_block_idx(args.cfg, 1, 1, **_coherent_options(args))  # the same checks
        except ValueError as e:
            if args.workload == "coherent":
                raise
            raise ValueError(
                f"--workload trained_fit ({TRAINED_FIT}, fitted at n_sel 16 with 3 forced "
                f"blocks) does not fit n_sel {args.cfg.n_sel} with {forced_count(args.cfg)} "
                f"forced blocks ({e}); use --workload coherent with --overlap, --working-set "
                "and --drift") from None


def _coherent_options(args) -> dict:
    """The coherent generator's keyword arguments from the benches' flags."""
    if args.workload == "trained_fit":
        return dict(TRAINED_FIT)
    return dict(overlap=args.overlap, working_set=getattr(args, "working_set", None),
                drift=getattr(args, "drift", 0.0))


def _replay(args, cfg, B: int, positions: np.ndarray) -> np.ndarray:
    """The saved selection's rows for `positions` [n] of B sequences: `[B, n, G, n_sel]`.
    Sequences repeat cyclically when the file holds fewer; a position past the file's last row
    takes its last row, still causal for a later query (its blocks are <= the earlier query's
    own block), so a decode run may outlast the file."""
    saved = load_selection(args.workload_file, cfg)
    rows = np.minimum(positions, saved.shape[1] - 1)
    return saved[np.arange(B) % saved.shape[0]][:, rows]


def prefill_block_idx(args, cfg, B: int, S: int) -> Optional[np.ndarray]:
    """The workload's block_idx `[B, S, G, n_sel]` of a prefill of S tokens; None for random.
    A trained selection must cover S positions."""
    if args.workload == "random":
        return None
    if args.workload in SYNTHETIC:
        return coherent_block_idx(cfg, B, S, seed=args.workload_seed, **_coherent_options(args))
    saved_T = np.load(args.workload_file, mmap_mode="r").shape[1]
    if saved_T < S:
        from bench.common import Skip

        raise Skip(f"{args.workload_file} holds {saved_T} positions, fewer than S = {S}")
    return _replay(args, cfg, B, np.arange(S))


def decode_block_idx(args, cfg, B: int, S: int, steps: int) -> Optional[np.ndarray]:
    """The workload's block_idx of `steps` decode steps at positions S, S + 1, ...:
    `[steps, B, 1, G, n_sel]` (one row per step, as `decode_step(block_idx=)` takes it);
    None for random."""
    if args.workload == "random":
        return None
    if args.workload in SYNTHETIC:
        rows = coherent_block_idx(cfg, B, S + steps, seed=args.workload_seed, start=S,
                                  **_coherent_options(args))
    else:
        rows = _replay(args, cfg, B, S + np.arange(steps))
    return rows.transpose(1, 0, 2, 3)[:, :, None]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Overlap statistics of a saved selection")
    parser.add_argument("--stats", required=True, help="a .npy selection [B, T, G, n_sel]")
    parser.add_argument("--tile", type=int, default=DEFAULT_TILE)
    parser.add_argument("--first", type=int, default=0, help="leave out the rows before this")
    args = parser.parse_args(argv)
    stats = overlap_stats(np.load(args.stats), tile=args.tile, first=args.first)
    print(f"{args.stats}: {format_stats(stats, args.tile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
