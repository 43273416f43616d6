"""The selection workloads of the benches (bench/workloads.py): the coherent generator's rows are
valid selections that reach their target overlap (with a working set, too, fitted to a trained
model's statistics), the overlap statistics on hand-built cases,
the saved-selection round trip, and the core and the decode step accepting a workload's
block_idx; the benches' CSV handling of the workload column."""
import argparse
import csv
import os

import numpy as np
import pytest

from bench import bench_decode, bench_prefill, common, workloads
from nsa_common import NSAConfig

# n_sel 8 with 3 forced blocks: overlaps from 0.375 to 1 are reachable.
CFG = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, cmp_block=8, cmp_stride=4,
                sel_block=16, n_sel=8, n_init=1, n_local=2, window=16, compress="mean")
OVERLAP_TOL = 0.03  # the generator's mean shared share against its target, over ~60k pairs


def _sets(row):
    return {int(b) for b in row if b >= 0}


def test_coherent_rows_are_valid_selections():
    B, T = 2, 700
    idx = workloads.coherent_block_idx(CFG, B, T, overlap=0.6, seed=3)
    assert idx.shape == (B, T, CFG.n_kv_heads, CFG.n_sel) and idx.dtype == np.int32
    workloads.check_selection(idx, CFG.sel_block)  # causal, ascending, distinct, -1 last
    for t in range(T):
        last = t // CFG.sel_block
        for b in range(B):
            for g in range(CFG.n_kv_heads):
                blocks = _sets(idx[b, t, g])
                assert len(blocks) == min(CFG.n_sel, last + 1)
                assert max(blocks) <= last
                forced = set(range(CFG.n_init)) | set(range(last - CFG.n_local + 1, last + 1))
                assert forced & set(range(last + 1)) <= blocks
                if last < CFG.n_sel:  # every eligible block, -1 padded
                    assert list(idx[b, t, g]) == list(range(last + 1)) + [-1] * (
                        CFG.n_sel - last - 1)


def test_coherent_rows_from_a_start_position():
    idx = workloads.coherent_block_idx(CFG, 3, 900, overlap=0.9, seed=1, start=800)
    assert idx.shape == (3, 100, CFG.n_kv_heads, CFG.n_sel)
    workloads.check_selection(idx, CFG.sel_block, start=800)


@pytest.mark.parametrize("overlap", [0.45, 0.7, 0.9, 1.0])
def test_coherent_reaches_its_target_overlap(overlap):
    T = 16 * 400
    idx = workloads.coherent_block_idx(CFG, 4, T, overlap=overlap, seed=7)
    # Past the first blocks, where few candidates make a redrawn block repeat an old one.
    stats = workloads.overlap_stats(idx, first=CFG.sel_block * 32)
    assert stats["shared"] == pytest.approx(overlap, abs=OVERLAP_TOL)
    if overlap == 1.0:
        # Only the local blocks move: a 64-query tile spans 64 / l_sel selection blocks.
        assert stats["tile_union"] == CFG.n_sel + workloads.DEFAULT_TILE // CFG.sel_block - 1


def test_higher_overlap_shrinks_the_tile_union():
    unions = [workloads.overlap_stats(workloads.coherent_block_idx(CFG, 1, 4000, overlap=o),
                                      first=1000)["tile_union"] for o in (0.45, 0.7, 0.95)]
    assert unions[0] > unions[1] > unions[2]


def test_overlap_out_of_range_is_refused():
    with pytest.raises(ValueError, match="overlap"):
        workloads.keep_probability(CFG, 0.2)  # below the forced share 3/8
    with pytest.raises(ValueError, match="overlap"):
        workloads.coherent_block_idx(CFG, 1, 100, overlap=1.2)
    assert workloads.keep_probability(CFG, 3 / 8) == 0.0
    assert workloads.keep_probability(CFG, 1.0) == 1.0


def test_working_set_rows_are_valid_reach_their_overlap_and_stay_in_the_set():
    B, T, ws = 2, 16 * 400, 12
    idx = workloads.coherent_block_idx(CFG, B, T, overlap=0.7, seed=4, working_set=ws)
    workloads.check_selection(idx, CFG.sel_block)
    last = np.arange(T) // CFG.sel_block
    late = last >= CFG.n_sel
    counts = (idx >= 0).sum(-1)
    assert (counts[:, late] == CFG.n_sel).all()
    assert (idx[:, late] == 0).any(-1).all()                     # n_init
    assert (idx[:, late] == last[late, None, None]).any(-1).all()  # the newest local block
    stats = workloads.overlap_stats(idx, first=CFG.sel_block * 32)
    assert stats["shared"] == pytest.approx(0.7, abs=OVERLAP_TOL)
    # Without drift, once the pool outgrows the set every free block is one of its ws members.
    n_cand = last - CFG.n_local - CFG.n_init + 1
    rows = np.nonzero(n_cand > ws)[0]
    for b in range(B):
        for g in range(CFG.n_kv_heads):
            blocks = idx[b, rows, g]
            free = blocks[(blocks >= CFG.n_init)
                          & (blocks <= last[rows, None] - CFG.n_local)]
            assert np.unique(free).size <= ws


def test_a_smaller_or_steadier_working_set_shrinks_the_tile_union():
    def union(**kw):
        idx = workloads.coherent_block_idx(CFG, 1, 6000, overlap=0.6, seed=1, **kw)
        stats = workloads.overlap_stats(idx, first=2000)
        assert stats["shared"] == pytest.approx(0.6, abs=OVERLAP_TOL)
        return stats["tile_union"]

    everywhere = union()
    assert union(working_set=10) < union(working_set=20) < everywhere
    assert union(working_set=10) < union(working_set=10, drift=0.05)


def test_the_trained_fit_matches_the_trained_models_statistics():
    """TRAINED_FIT's synthetic selection has the overlap statistics of the trained recall
    model's exported selection it was fitted to (bench configuration, 8k)."""
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "results",
                        "recall_benchmark_token_shift_h200", "nsa_aligned_s2",
                        "selection_T8192.npy")
    cfg = NSAConfig.paper(d_k=128)
    trained = workloads.overlap_stats(workloads.load_selection(path, cfg))
    fit = workloads.overlap_stats(workloads.coherent_block_idx(cfg, 1, 8192,
                                                               **workloads.TRAINED_FIT))
    assert fit["shared"] == pytest.approx(trained["shared"], abs=0.01)
    assert fit["tile_union"] == pytest.approx(trained["tile_union"], abs=1.5)
    assert fit["jaccard"] == pytest.approx(trained["jaccard"], abs=0.04)
    plain = workloads.overlap_stats(workloads.coherent_block_idx(
        cfg, 1, 8192, overlap=workloads.TRAINED_FIT["overlap"]))
    assert plain["tile_union"] > trained["tile_union"] + 10  # what the working set adds


def test_working_set_arguments_are_named():
    with pytest.raises(ValueError, match="working_set"):
        workloads.coherent_block_idx(CFG, 1, 100, overlap=0.7, working_set=9)  # < 2 x 5 free
    with pytest.raises(ValueError, match="drift"):
        workloads.coherent_block_idx(CFG, 1, 100, overlap=0.7, working_set=12, drift=1.5)
    args = argparse.Namespace(workload="random", workload_file=None, overlap=0.8, cfg=CFG,
                              working_set=12, drift=0.0)
    with pytest.raises(ValueError, match="--working-set"):
        workloads.check_workload_args(args)
    args.workload = "coherent"
    workloads.check_workload_args(args)
    args.working_set = 4
    with pytest.raises(ValueError, match="working_set"):
        workloads.check_workload_args(args)


def test_trained_fit_is_the_fitted_coherent_workload():
    args = argparse.Namespace(workload="trained_fit", workload_file=None, overlap=0.8, cfg=CFG,
                              working_set=None, drift=0.0, workload_seed=3)
    workloads.check_workload_args(args)
    np.testing.assert_array_equal(
        workloads.prefill_block_idx(args, CFG, 1, 900),
        workloads.coherent_block_idx(CFG, 1, 900, seed=3, **workloads.TRAINED_FIT))
    rows = workloads.decode_block_idx(args, CFG, 2, 800, 5)
    assert rows.shape == (5, 2, 1, CFG.n_kv_heads, CFG.n_sel)
    args.working_set = 20
    with pytest.raises(ValueError, match="--working-set"):
        workloads.check_workload_args(args)
    # A configuration the fit cannot reach (n_sel 4, 3 forced blocks: overlap >= 0.75).
    args.working_set, args.cfg = None, NSAConfig.tiny()
    with pytest.raises(ValueError, match="trained_fit"):
        workloads.check_workload_args(args)


def test_overlap_stats_on_hand_built_rows():
    # One sequence, one KV head, n_sel 3, four queries.
    rows = np.array([[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, -1, -1]], np.int32)
    idx = rows[None, :, None, :]
    # t -> t+1: {0,1,2}&{0,1,3} = 2 of union 4; {0,1,3}&{0,4,5} = 1 of 5; {0,4,5}&{0} = 1 of 3
    stats = workloads.overlap_stats(idx, tile=2)
    assert stats["shared"] == pytest.approx((2 + 1 + 1) / 3 / 3)
    assert stats["jaccard"] == pytest.approx((2 / 4 + 1 / 5 + 1 / 3) / 3)
    # Tiles of 2 rows: {0,1,2,3} and {0,4,5}.
    assert stats["tile_union"] == pytest.approx((4 + 3) / 2)
    # From the second row on; one tile of 2 rows ({0,1,3,4,5}), the last row left out.
    later = workloads.overlap_stats(idx, tile=2, first=1)
    assert later["shared"] == pytest.approx((1 + 1) / 2 / 3)
    assert later["tile_union"] == 5
    assert np.isnan(workloads.overlap_stats(idx[:, :1], tile=2)["shared"])


def test_saved_selection_round_trip_and_replay(tmp_path):
    path = str(tmp_path / "sel.npy")
    saved = workloads.coherent_block_idx(CFG, 2, 300, overlap=0.8, seed=2)
    workloads.save_selection(path, saved)
    np.testing.assert_array_equal(workloads.load_selection(path, CFG), saved)
    args = argparse.Namespace(workload="trained", workload_file=path, overlap=0.8,
                              workload_seed=0, cfg=CFG)
    workloads.check_workload_args(args)
    # Prefill: the first S positions; three sequences cycle over the two saved.
    prefill = workloads.prefill_block_idx(args, CFG, 3, 200)
    np.testing.assert_array_equal(prefill[2], saved[0, :200])
    with pytest.raises(common.Skip, match="300 positions"):
        workloads.prefill_block_idx(args, CFG, 1, 400)
    # Decode past the file's last row replays that row (still causal later on).
    rows = workloads.decode_block_idx(args, CFG, 2, 290, 20)
    assert rows.shape == (20, 2, 1, CFG.n_kv_heads, CFG.n_sel)
    np.testing.assert_array_equal(rows[15, :, 0], saved[:, 299])
    bad = saved.copy()
    bad[0, 5, 0, 0] = 3  # position 5 cannot select block 3
    workloads.save_selection(path, bad)
    with pytest.raises(ValueError, match="after its query"):
        workloads.load_selection(path, CFG)


def test_workload_arguments():
    args = argparse.Namespace(workload="trained", workload_file=None, overlap=0.8, cfg=CFG)
    with pytest.raises(ValueError, match="workload-file"):
        workloads.check_workload_args(args)
    args = argparse.Namespace(workload="random", workload_file=None, overlap=0.8, cfg=CFG)
    assert workloads.prefill_block_idx(args, CFG, 1, 64) is None
    assert workloads.decode_block_idx(args, CFG, 1, 64, 4) is None


def _core_inputs(B, T):
    import jax

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(keys[0], (B, T, CFG.n_heads, CFG.d_k)),
            jax.random.normal(keys[1], (B, T, CFG.n_kv_heads, CFG.d_k)),
            jax.random.normal(keys[2], (B, T, CFG.n_kv_heads, CFG.d_v)),
            jax.random.normal(keys[3], (B, T, CFG.n_heads, 3)))


def test_core_accepts_the_workload():
    import nsa_jax

    B, T = 1, 160
    q, k, v, gates = _core_inputs(B, T)
    forced = workloads.coherent_block_idx(CFG, B, T, overlap=0.7, seed=5)
    o, aux = nsa_jax.native_sparse_attention(q, k, v, gates, CFG, gates_are_logits=True,
                                             block_idx=forced, return_aux=True)
    np.testing.assert_array_equal(np.asarray(aux["block_idx"]), forced)
    assert np.isfinite(np.asarray(o)).all()
    own = workloads.core_selection(q, k, v, gates, CFG)
    workloads.check_selection(own, CFG.sel_block)
    assert own.shape == forced.shape and not np.array_equal(own, forced)


@pytest.mark.slow
def test_decode_step_accepts_the_workload_rows():
    import jax
    import jax.numpy as jnp
    import nsa_jax

    B, S = 2, 160
    params = nsa_jax.init_params(jax.random.PRNGKey(1), CFG)
    cache = bench_decode.random_cache(nsa_jax.init_cache(CFG, B, S + 4), S,
                                      jax.random.PRNGKey(2))
    args = argparse.Namespace(workload="coherent", overlap=0.7, workload_seed=0)
    rows = workloads.decode_block_idx(args, CFG, B, S, 2)
    workloads.check_selection(rows[:, :, 0].transpose(1, 0, 2, 3), CFG.sel_block, start=S)
    _, _, _, aux = nsa_jax.decode_step(params, jnp.ones((B, 1, CFG.d_model)), CFG, cache,
                                       block_idx=rows[0], return_aux=True)
    np.testing.assert_array_equal(np.asarray(aux["block_idx"]), rows[0])


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_prefill_latest_rows_keep_workloads_apart():
    base = {"row": "nsa_jax_pallas", "S": 8192, "status": "ok", "device": "gpu"}
    records = [dict(base, **{"pass": p}, ms=ms, workload=w)
               for w, ms in (("random", 3.0), ("coherent", 2.0)) for p in ("fwd", "fwd_bwd")]
    records += [dict(base, row="fa3_full", **{"pass": p}, ms=1.5, workload=w)
                for w in ("random", "coherent") for p in ("fwd", "fwd_bwd")]
    lines = bench_prefill.latest_rows(records, "abc")
    got = {(line["row"], line["workload"]): line["fwd_ms"] for line in lines}
    assert got == {("nsa_jax_pallas", "random"): 3.0, ("nsa_jax_pallas", "coherent"): 2.0,
                   ("fa3_full", "random"): 1.5, ("fa3_full", "coherent"): 1.5}
    assert bench_prefill.LATEST_COLUMNS[:8] == ["row", "S", "fwd_ms", "fwd_bwd_ms", "peak_mb",
                                                "device", "commit", "status"]
    bench_prefill.add_speedups(records, None)
    coherent = [r for r in records if r["workload"] == "coherent" and r["row"] != "fa3_full"]
    assert all(r["speedup"] == pytest.approx(0.75) for r in coherent)
    # A record written before the column existed is the random workload.
    assert bench_prefill.workload_of({"row": "x"}) == "random"


def test_decode_latest_keeps_the_other_workloads(tmp_path):
    path = str(tmp_path / "decode_latest.csv")
    # A file from before the workload column: its lines are the random workload's.
    old_columns = bench_decode.LATEST_COLUMNS[:-1]
    common.write_csv(path, [dict(B=1, S=65536, nsa_ms=0.1, device="H100", commit="old")],
                     old_columns)

    def records(ms):
        return [{"row": "nsa_jax", "mode": "full", "B": 1, "S": 65536, "status": "ok",
                 "ms": ms}]

    bench_decode.write_latest(records(0.08), path, "H100", "new", workload="coherent")
    lines = _read(path)
    assert [(line["workload"], line["nsa_ms"], line["commit"]) for line in lines] == [
        ("random", "0.1", "old"), ("coherent", "0.08", "new")]
    # Rewriting a workload replaces its own lines only.
    bench_decode.write_latest(records(0.09), path, "H100", "newer", workload="random")
    lines = _read(path)
    assert sorted((line["workload"], line["nsa_ms"]) for line in lines) == [
        ("coherent", "0.08"), ("random", "0.09")]
    assert list(lines[0]) == bench_decode.LATEST_COLUMNS
    assert os.path.isfile(str(tmp_path / "decode_latest_breakdown.csv"))
