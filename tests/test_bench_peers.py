"""bench/bench_peers.py and its adapters (bench/peers/) on a CPU: the arguments, a peer without a
checkout skipped with its reason, our side's configuration of each peer, the layout and window
helpers the adapters share, and (slow) the check and the timing run end to end with the torch
reference standing in for a peer, a planted fault marked "mismatch" and left untimed.

The peers' own kernels cannot run here: mdy666's package queries the CUDA device when it is
imported and FSA's ops allocate on "cuda", so there is no Triton-interpreter agreement test of
them; the GPU run checks them before it times them."""
import argparse
import csv
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from bench import bench_peers, common
from bench.peers import (PEERS, adapter, fla, from_heads_first, fsa, heads_first, mdy666,
                         mean_pool, window)
from nsa_common import NSAConfig

TINY = NSAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, cmp_block=8,
                 cmp_stride=4, sel_block=16, n_sel=4, n_init=1, n_local=2, window=16,
                 compress="mean", shared_kv=True)
FLOAT32_TOL = 1e-5


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# Arguments and skipping
# ---------------------------------------------------------------------------------------------
def test_arguments():
    args = bench_peers.parse_args(["--device", "cpu"])
    assert args.peers == list(PEERS) and args.S == [8192, 16384, 32768, 65536, 131072]
    assert args.passes == ["fwd", "fwd_bwd", "decode"] and args.decode_B == [1, 32]
    assert args.decode_S == args.S
    assert args.paths == {"mdy666": os.path.join(common.REPO_ROOT, ".peers", "mdy666"),
                          "fsa": os.path.join(common.REPO_ROOT, ".peers", "fsa"), "fla": None}
    assert args.dtype == "bfloat16" and args.backend == "xla"
    args = bench_peers.parse_args(["--device", "gpu", "--peers", "fsa", "--peer-path",
                                   "fsa=/x/fsa", "--heads", "fsa=16/4", "--passes", "decode",
                                   "--dtype", "fp16", "--S_list", "64k", "--decode_S_list",
                                   "8k,64k"])
    assert args.peers == ["fsa"] and args.paths["fsa"] == "/x/fsa"
    assert args.decode_S == [8192, 65536] and bench_peers.all_lengths(args) == [8192, 65536]
    assert bench_peers._points(args) == [(p, S, B) for S in (8192, 65536) for B in (1, 32)
                                         for p in ("decode", "decode_graph")]
    cfg = bench_peers.peer_config(args, "fsa")
    assert (cfg.n_heads, cfg.n_kv_heads) == (16, 4)
    for bad, match in ((["--peers", "nope"], "--peers"), (["--peer-path", "mdy666"], "NAME"),
                       (["--peer-path", "other=/x"], "names no peer"),
                       (["--heads", "fsa=16/5"], "multiple"), (["--heads", "fsa=16"], "H/G"),
                       (["--passes", "fwd,bwd"], "--passes"),
                       (["--min_block_agreement", "2"], "min_block_agreement")):
        with pytest.raises(ValueError, match=match):
            bench_peers.parse_args(["--device", "cpu"] + bad)
    with pytest.raises(SystemExit):  # float32: the peers' kernels take half precision only
        bench_peers.parse_args(["--device", "cpu", "--dtype", "float32"])


def test_missing_checkout_is_skipped_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMMIT", "testcommit")
    out = tmp_path / "peers"
    code = bench_peers.main(["--device", "cpu", "--peers", "mdy666,fsa", "--peer-path",
                             f"mdy666={tmp_path / 'absent'}", "--peer-path",
                             f"fsa={tmp_path / 'absent_too'}", "--S_list", "1k",
                             "--decode_B", "1", "--isolate", "none", "--no_progress",
                             "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"mdy666: skipped: no checkout at {tmp_path / 'absent'}" in printed
    rows = _read(out / "peers.csv")
    assert list(rows[0]) == bench_peers.COLUMNS
    assert {r["status"] for r in rows} == {"skipped"}
    peer_rows = [r for r in rows if r["row"] == "peer"]
    assert {(r["peer"], r["pass"]) for r in peer_rows} == {
        (p, x) for p in ("mdy666", "fsa") for x in ("fwd", "fwd_bwd", "decode", "decode_graph")}
    assert all("no checkout at" in r["note"] for r in peer_rows)
    ours = [r for r in rows if r["row"] == "ours"]
    assert ours and all("the peer did not run" in r["note"] for r in ours)
    # Our side of each peer is written in the peer's configuration.
    assert {(r["peer"], r["H"], r["w"]) for r in ours} == {("mdy666", "64", "513"),
                                                          ("fsa", "4", "513")}
    assert (out / "peers_summary.txt").read_text().startswith("NSA peers side by side")


def _fsa_checkout(root, line):
    source = root / fsa.KERNEL_FILE
    source.parent.mkdir(parents=True)
    source.write_text(f"def reduce_kernel(lse_ptr, pid_q_j, stride_lse_n):\n    {line}\n")
    return root


def test_fsa_checkout_that_triton_3_6_cannot_compile_is_named(tmp_path, monkeypatch):
    """FSA's 1-tuple pointer: from Triton 3.6 on, the line and its fix are the skip reason
    (before its kernels compile and fail); the line written as a pointer, an older Triton or
    no checkout pass."""
    tuple_line = _fsa_checkout(tmp_path / "tuple", fsa.TUPLE_POINTER)
    fixed = _fsa_checkout(tmp_path / "fixed", fsa.POINTER)
    why = fsa.triton_incompatibility(str(tuple_line), "3.6.0")
    assert f"{fsa.KERNEL_FILE}:2" in why and "Triton 3.6.0" in why
    assert "`lse_ptrs = lse_ptr + pid_q_j * stride_lse_n`" in why
    assert fsa.triton_incompatibility(str(tuple_line), "3.10.1") is not None
    assert fsa.triton_incompatibility(str(tuple_line), "3.5.0") is None
    assert fsa.triton_incompatibility(str(fixed), "3.6.0") is None
    assert fsa.triton_incompatibility(None, "3.6.0") is None
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    with pytest.raises(common.Skip, match="1-tuple"):
        fsa.load(str(tuple_line), fsa.config())


def test_ours_runs_the_passes_the_peer_ran():
    args = argparse.Namespace(passes=["fwd", "fwd_bwd", "decode"])
    records = [{"peer": "fla", "row": "peer", "pass": p, "status": s}
               for p, s in (("fwd", "ok"), ("fwd_bwd", "mismatch"), ("decode", "skipped"),
                            ("decode_graph", "skipped"))]
    assert bench_peers.ours_passes(args, records, "fla") == ["fwd", "fwd_bwd"]
    assert bench_peers.ours_passes(args, records, "mdy666") == []


def test_summary_takes_each_side_s_window_out():
    def record(row, ms, p="fwd_bwd"):
        return {"peer": "mdy666", "row": row, "pass": p, "S": 8192, "B": 1, "status": "ok",
                "ms": ms}

    records = [record("ours", 9.0), record("ours_window", 2.0), record("peer", 10.0),
               record("window_standin", 2.5)]
    header, row = bench_peers.summary_table(records).splitlines()[0:3:2]
    values = dict(zip(header.split(), row.split()))
    assert float(values["speedup"]) == pytest.approx(10.0 / 9.0, abs=5e-3)
    assert float(values["speedup_wo_standin"]) == pytest.approx(7.5 / 9.0, abs=5e-3)
    assert float(values["ours_window_ms"]) == 2.0
    assert float(values["speedup_wo_windows"]) == pytest.approx(7.5 / 7.0, abs=5e-3)
    # Without our window's time the ratio is not given.
    table = bench_peers.summary_table(records[:1] + records[2:])
    assert table.splitlines()[2].split()[10] == "-"


# ---------------------------------------------------------------------------------------------
# Our side's configuration of each peer
# ---------------------------------------------------------------------------------------------
def test_configurations_of_the_peers():
    from bench.fla_setup import fla_config

    for module, heads in ((mdy666, (64, 4)), (fsa, (4, 4))):
        cfg = module.config()
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v) == (*heads, 128, 128)
        assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_sel) == (32, 16, 64, 16)
        assert (cfg.n_init, cfg.n_local) == (1, 2)
        # flash-attn's window_size=(512, -1) is keys t - 512 .. t: 513 of ours.
        assert cfg.window == module.WINDOW + 1 == 513
        assert cfg.compress == "mean" and cfg.shared_kv
        assert module.config((8, 2)).n_heads == 8 and module.config((8, 2)).n_kv_heads == 2
    assert fla.config() == fla_config(common.nsa_preset("bench"))
    assert fla.config((32, 2)).n_heads == 32
    for name in PEERS:
        module = adapter(name)
        assert module.NAME == name and "/" in module.REPO
        assert module.notes(module.config())
    with pytest.raises(ValueError, match="peer"):
        adapter("other")


# ---------------------------------------------------------------------------------------------
# Layouts and the window stand-in
# ---------------------------------------------------------------------------------------------
def test_selection_layouts_round_trip():
    from nsa_common.testing import random_block_idx

    B, S, G, n, block = 2, 80, 3, 4, 16
    ours = torch.as_tensor(random_block_idx(0, B, S, G, n, block, n_init=1, n_local=2))
    n_blocks = math.ceil(S / block)
    peer = heads_first(ours, fill=n_blocks)
    assert peer.shape == (G, B * S, n) and peer.dtype == torch.int32
    assert (peer[ours.permute(2, 0, 1, 3).reshape(G, B * S, n) < 0] == n_blocks).all()
    # A peer's order (scores, padding anywhere, a wider row) comes back in ours.
    shuffled = peer[..., torch.randperm(n)]
    wide = torch.cat([shuffled, torch.full((G, B * S, 2), -1, dtype=torch.int32)], -1)
    assert torch.equal(from_heads_first(wide, B, S, n, block), ours)
    assert torch.equal(from_heads_first(peer[..., :2], B, S, n, block)[..., 2:],
                       torch.full((B, S, G, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="more than n_sel"):
        from_heads_first(torch.zeros(1, 1, 3, dtype=torch.int32) + torch.arange(3), 1, 1, 2,
                         block, first=64)


def test_mean_pool_is_our_mean_compression():
    import jax.numpy as jnp
    from nsa_jax.dispatch import call

    x = torch.randn(2, 70, 2, 8)
    pooled = mean_pool(x, 8, 4)
    assert pooled.shape == (2, (70 - 8) // 4 + 1, 2, 8)
    cfg = TINY.replace(d_k=8, d_v=8)
    ours = call("compress_kv", "xla", jnp.asarray(x.numpy()), None, cfg)
    np.testing.assert_allclose(pooled.numpy(), np.asarray(ours), rtol=FLOAT32_TOL,
                               atol=FLOAT32_TOL)


def test_window_stand_in_is_the_spec_window_of_left_plus_one_keys():
    from nsa_torch_ref import reference

    B, S, H, G, d, left = 2, 40, 4, 2, 8, 9
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, d, generator=gen, dtype=torch.float64)
               for h in (H, G, G))
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    leaves = [x.reshape(B * S, *x.shape[2:]).clone().requires_grad_(True) for x in (q, k, v)]
    assert window.kernel(leaves[0]) == "reference"
    o = window.attention(*leaves, cu, S, left, d ** -0.5)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = reference.sliding_window_attention(*ref_leaves, left + 1)
    np.testing.assert_allclose(o.detach().reshape(B, S, H, d).numpy(), ref.detach().numpy(),
                               rtol=1e-10, atol=1e-12)
    cot = torch.randn(B, S, H, d, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(o, leaves, cot.reshape(B * S, H, d))
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got.reshape(want.shape).numpy(), want.numpy(), rtol=1e-9,
                                   atol=1e-11)
    # The decode form: the last query of each sequence.
    last = window.decode(q[:, -1], k, v, left, d ** -0.5)
    np.testing.assert_allclose(last.numpy(), ref[:, -1].detach().numpy(), rtol=1e-10,
                               atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The check and the timing, end to end, with the torch reference as the peer
# ---------------------------------------------------------------------------------------------
class ReferencePeer:
    """nsa_torch_ref's reference core behind the adapter interface; `scale` plants a fault."""

    impl = "nsa_torch_ref reference"

    def __init__(self, cfg, scale: float = 1.0):
        self.cfg, self.scale = cfg, scale

    def prefill(self, q, k, v, gate_logits, block_idx=None):
        from nsa_torch_ref import native_sparse_attention

        o, aux = native_sparse_attention(q, k, v, gate_logits, self.cfg, gates_are_logits=True,
                                         block_idx=block_idx, return_aux=True)
        self.used = aux["block_idx"]
        return o * self.scale

    def last_selection(self):
        return self.used

    def window(self, q, k, v):
        return None

    def decode_case(self, k, v, q_last, gate_last, block_idx=None):
        from bench.peers import DecodeCase

        B, S = k.shape[:2]
        q = torch.zeros(B, S, *q_last.shape[1:], dtype=q_last.dtype)
        gates = torch.zeros(B, S, *gate_last.shape[1:], dtype=gate_last.dtype)
        q[:, -1], gates[:, -1] = q_last, gate_last
        used = {}

        def step():
            forced = None
            if block_idx is not None:
                self.prefill(q, k, v, gates)
                forced = self.last_selection().clone()
                forced[:, -1] = block_idx
            o = self.prefill(q, k, v, gates, block_idx=forced)
            used["idx"] = self.last_selection()
            return o[:, -1]

        return DecodeCase(step=step, block_idx=lambda: used["idx"][:, -1])


def _args(tmp_path):
    args = bench_peers.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "0",
                                   "--repeats", "1", "--rotate", "1", "--out", str(tmp_path)])
    args.device_label, args.commit, args.dtype_torch = "cpu", "testcommit", torch.bfloat16
    return args


@pytest.mark.slow
def test_check_and_timing_end_to_end(tmp_path):
    args = _args(tmp_path)
    S = 96
    checks = []
    records = bench_peers.peer_prefill(args, ReferencePeer(TINY), TINY, "reference", S, checks)
    by_pass = {r["pass"]: r for r in records if r["row"] == "peer"}
    for p in ("fwd", "fwd_bwd"):
        assert by_pass[p]["status"] == "ok" and by_pass[p]["ms"] > 0, by_pass[p]
        assert by_pass[p]["check"] == "pass" and by_pass[p]["rel_l2"] < 1e-2
        assert by_pass[p]["blocks_agree"] >= args.min_block_agreement
    assert {(c["selection"], c["what"]) for c in checks} == {
        (s, w) for s in ("own", "shared") for w in bench_peers.QUANTITIES}
    assert all(c["verdict"] == "pass" for c in checks if c["selection"] == "shared")
    # A peer 5% off: both passes marked and left untimed.
    records = bench_peers.peer_prefill(args, ReferencePeer(TINY, scale=1.05), TINY,
                                       "reference", S, [])
    for r in records:
        assert r["status"] == bench_peers.MISMATCH and r.get("ms") is None
        assert r["check"].startswith("fail: o ")
    # Decode: the check at S - 1, then the eager step; no CUDA graph on a CPU.
    decode = {r["pass"]: r for r in bench_peers.peer_decode(args, ReferencePeer(TINY), TINY,
                                                            "reference", S, 2, checks)}
    assert decode["decode"]["status"] == "ok" and decode["decode"]["check"] == "pass"
    assert decode["decode_graph"]["status"] == "skipped"
    assert [c["selection"] for c in checks if c["kind"] == "decode"] == ["own", "shared"]
    table = bench_peers.summary_table(records + list(decode.values()))
    assert "decode" in table and "mismatch" in table


@pytest.mark.slow
def test_our_side_in_a_peer_configuration(tmp_path):
    args = _args(tmp_path)
    args.heads = {"mdy666": (4, 2)}
    args.S, args.decode_S, args.decode_B, args.loop_steps = [256], [256], [1], 2
    records, _ = bench_peers.run_ours_side(args, "mdy666")
    by = {(r["row"], r["pass"]): r for r in records}
    assert set(by) == {("ours", "fwd"), ("ours", "fwd_bwd"), ("ours_window", "fwd"),
                       ("ours_window", "fwd_bwd"), ("ours", "decode"), ("ours_step", "decode")}
    for r in records:
        assert r["status"] == "ok" and r["w"] == 513 and r["compress"] == "mean", r
    assert by[("ours", "decode")]["ms"] <= by[("ours_step", "decode")]["ms"]
    assert by[("ours_window", "fwd")]["impl"].startswith("nsa_jax.sliding_window_attention")
