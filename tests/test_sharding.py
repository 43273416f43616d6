"""nsa_jax.sharding: the specs on one device, and the 8-device tests of `test_sharding_mesh.py`
run in a subprocess with 8 fake CPU devices (the rest of the suite keeps one device)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import nsa_jax
from nsa_common import NSAConfig
from nsa_jax import sharding

HERE = os.path.dirname(os.path.abspath(__file__))


def run_eight_device_cases(marker: str, keyword: str = "") -> None:
    """test_sharding_mesh.py's tests selected by `-m marker` (and `-k keyword`), in a
    subprocess with 8 fake CPU devices: all pass, none skips."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", marker,
               "-k", keyword, os.path.join(HERE, "test_sharding_mesh.py")]
    proc = subprocess.run(command, cwd=os.path.dirname(HERE), env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " skipped" not in proc.stdout, proc.stdout[-2000:]


def test_eight_device_cases():
    run_eight_device_cases("not slow")


# The slow cases in two processes of about a minute each, which two workers run side by side:
# the cuDNN reproducer script (a layer gradient at T 2048) and all the others.
@pytest.mark.slow
@pytest.mark.parametrize("keyword", ["test_cudnn_repro_script", "not test_cudnn_repro_script"],
                         ids=["repro_script", "others"])
def test_eight_device_slow_cases(keyword):
    run_eight_device_cases("slow", keyword)


@pytest.mark.parametrize("cfg", [NSAConfig.tiny(), NSAConfig.tiny(shared_kv=True, compress="mean")])
def test_param_specs_cover_every_parameter(cfg):
    """One spec per parameter, of the parameter's rank, splitting exactly its head axis."""
    axes = sharding.MeshAxes(model="m")
    params = nsa_jax.init_params(jax.random.PRNGKey(0), cfg)
    specs = sharding.param_specs(cfg, axes)
    assert jax.tree_util.tree_structure(specs, is_leaf=lambda s: isinstance(s, P)) == \
        jax.tree_util.tree_structure(params)
    head_axis = {"wo": 0, "bg": 0, "cmp_k": 0, "cmp_v": 0}
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params), spec_leaves):
        axis = head_axis.get(path[0].key, 1)
        assert len(spec) == leaf.ndim and spec[axis] == "m" and spec.count("m") == 1, (path, spec)


def test_cache_specs():
    axes = sharding.MeshAxes(data="d", model="m", context="c")
    specs = sharding.cache_specs(NSAConfig.tiny(), axes)
    assert specs.lengths == P("d") and specs.overflow == P("d")
    per_token = [spec for name, spec in zip(specs._fields, specs)
                 if name not in ("lengths", "overflow")]
    assert per_token and all(spec == P("d", None, "m", None) for spec in per_token)


def test_context_bytes_per_layer():
    """Compressed all-gather = remote share of T/d blocks; selected = remote share of T tokens."""
    cfg = NSAConfig.paper()
    T, c = 128 * 1024, 8
    cost = sharding.context_bytes_per_layer(cfg, T, c)
    token = cfg.n_kv_heads * (cfg.d_k + cfg.d_v) * 2
    assert cost["sel_allgather"] == T * 7 / 8 * token
    assert cost["cmp_allgather"] == ((T - cfg.cmp_block) // cfg.cmp_stride + 1) * 7 / 8 * token
    assert cost["win_halo"] == (cfg.window - 1) * token
    assert sharding.context_bytes_per_layer(cfg, T, 1)["sel_allgather"] == 0


def test_bench_scaling_points():
    """Strong scaling keeps (B, T); weak scaling grows B with data and T with context, up to
    --tokens on the widest context axis."""
    from bench import bench_scaling

    args = bench_scaling.parse_args(["--tokens", "1024k", "--meshes", "1x1x1,2x2x4,1x1x8",
                                     "--batch", "2"])
    got = {(p["scaling"], p["data"], p["model"], p["context"]): (p["B"], p["T"])
           for p in bench_scaling.points(args)}
    T = 1024 * 1024
    assert got == {("strong", 1, 1, 1): (2, T), ("strong", 2, 2, 4): (2, T),
                   ("strong", 1, 1, 8): (2, T), ("weak", 1, 1, 1): (2, T // 8),
                   ("weak", 2, 2, 4): (4, T // 2), ("weak", 1, 1, 8): (2, T)}
    with pytest.raises(ValueError, match="--meshes"):
        bench_scaling.parse_args(["--meshes", "2x2"])


def test_runs_under_a_set_mesh():
    """mesh=None takes the mesh of `jax.set_mesh` (here a 1 x 1 one: the layer unchanged)."""
    from jax_inputs import make_inputs
    from nsa_common.testing import rel_err

    cfg = NSAConfig.tiny()
    params, x = make_inputs(cfg, 1, 24, jnp.float32)
    with pytest.raises(ValueError, match="no mesh is set"):
        sharding.sharded_nsa_attention(params, x, cfg)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with jax.set_mesh(mesh):
        y = sharding.sharded_nsa_attention(params, x, cfg)
    assert rel_err(y, nsa_jax.nsa_attention(params, x, cfg)) <= 1e-6


def test_bench_scaling_weak_efficiency_per_tokens():
    """Weak rows are compared with the first mesh's row of the same --tokens value (the T the
    widest context axis reaches), strong rows with the same T."""
    from bench import bench_scaling

    def row(scaling, mesh, T, ms, B=1):
        data, model, context = (int(v) for v in mesh.split("x"))
        return dict(scaling=scaling, mesh=mesh, data=data, model=model, context=context,
                    devices=data * model * context, T=T, B=B, ms=ms, status="ok",
                    **{"pass": "fwd"})

    rows = [row("strong", "1x1x1", 64, 10.0), row("strong", "1x1x2", 64, 6.0),
            row("strong", "1x1x1", 128, 30.0), row("strong", "1x1x2", 128, 20.0),
            row("weak", "1x1x1", 32, 4.0), row("weak", "1x1x2", 64, 5.0),
            row("weak", "1x1x1", 64, 10.0), row("weak", "1x1x2", 128, 20.0)]
    bench_scaling.add_efficiency(rows, (1, 1, 1), widest=2)
    assert [r["efficiency"] for r in rows] == [1.0, 10 / 12, 1.0, 0.75, 1.0, 0.8, 1.0, 0.5]


def test_bench_scaling_keeps_the_forward_when_the_backward_runs_out_of_memory(tmp_path,
                                                                              monkeypatch):
    """A pass that runs out of memory is an `oom` row of its own: the forward's timing of the
    same point stays (a 1M-token forward was once lost to its backward's OOM)."""
    from bench import bench_scaling, common

    real = bench_scaling._layer_step

    def layer_step(cfg, mesh, axes, backend, pass_name, fa3=True):
        if pass_name == "fwd_bwd":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real(cfg, mesh, axes, backend, pass_name, fa3)

    monkeypatch.setattr(bench_scaling, "_layer_step", layer_step)
    path = tmp_path / "scaling.csv"
    assert bench_scaling.main(["--device", "cpu", "--preset", "tiny", "--tokens", "32",
                               "--meshes", "1x1x1", "--scaling", "strong", "--dtype", "float32",
                               "--iters", "1", "--warmup", "1", "--repeats", "1",
                               "--csv", str(path)]) == 0
    rows = {r["pass"]: r for r in common.read_csv(str(path))}
    assert rows["fwd"]["status"] == "ok" and float(rows["fwd"]["ms"]) > 0
    assert float(rows["fwd"]["efficiency"]) == 1
    assert rows["fwd_bwd"]["status"] == "oom" and rows["fwd_bwd"]["ms"] == ""
    assert "RESOURCE_EXHAUSTED" in rows["fwd_bwd"]["note"]


def test_bench_scaling_without_fa3(tmp_path, monkeypatch):
    """--no_fa3 hands the layer PallasOptions(fa3=False) and labels the rows' backend."""
    import nsa_jax
    from bench import bench_scaling, common
    from nsa_jax import sharding

    seen = []
    real = sharding.sharded_nsa_attention

    def sharded(*args, options=None, **kwargs):
        seen.append(options)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(sharding, "sharded_nsa_attention", sharded)
    path = tmp_path / "scaling.csv"
    assert bench_scaling.main(["--device", "cpu", "--preset", "tiny", "--tokens", "32",
                               "--meshes", "1x1x1", "--scaling", "strong", "--dtype", "float32",
                               "--backend", "pallas", "--no_fa3", "--passes", "fwd",
                               "--iters", "1", "--warmup", "0", "--repeats", "1",
                               "--csv", str(path)]) == 0
    rows = common.read_csv(str(path))
    assert [(r["backend"], r["status"]) for r in rows] == [("pallas (fa3 off)", "ok")]
    assert seen and all(o == {"pallas": nsa_jax.PallasOptions(fa3=False)} for o in seen)


def test_bench_scaling_isolated_points(tmp_path):
    """--isolate: each pass of each point runs in its own process and gives the same rows as
    in-process (status ok, timed); a pass that outlives --point_timeout is a 'timeout' row."""
    from bench import bench_scaling, common

    point = dict(data=2, model=1, context=4, B=3, T=4096)
    assert bench_scaling.parse_worker_key(bench_scaling.worker_key(point, "fwd_bwd")) == (
        point, "fwd_bwd")
    base = ["--device", "cpu", "--preset", "tiny", "--tokens", "32", "--meshes", "1x1x1",
            "--scaling", "strong", "--dtype", "float32", "--iters", "1", "--warmup", "0",
            "--repeats", "1", "--isolate"]
    path = tmp_path / "scaling.csv"
    assert bench_scaling.main(base + ["--csv", str(path)]) == 0
    rows = common.read_csv(str(path))
    assert [(r["pass"], r["status"]) for r in rows] == [("fwd", "ok"), ("fwd_bwd", "ok")]
    assert all(float(r["ms"]) > 0 and float(r["peak_mb_per_device"]) > 0 for r in rows)
    assert bench_scaling.main(base + ["--csv", str(path), "--point_timeout", "0.5"]) == 0
    rows = common.read_csv(str(path))
    assert [(r["pass"], r["status"]) for r in rows] == [("fwd", "timeout"),
                                                         ("fwd_bwd", "timeout")]
    assert all(r["ms"] == "" for r in rows)
