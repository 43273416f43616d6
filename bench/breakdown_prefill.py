"""Per-kernel breakdown of the NSA prefill core, and kernel variants side by side.

Times, at each S, every stage of the attention core as `bench_prefill.py`'s core (and the layer)
calls it, forward and forward+backward where the stage has a gradient:

  compress   compress_kv of the compressed branch's k and v (MLP or mean)
  cmp_attn   compressed_attention(..., return_lse=True)
  select     select_blocks(..., lse=lse) (no gradient)
  selected   selected_attention on the block_idx the selection chose
  window     sliding_window_attention
  window_fa3 the same window through FlashAttention-3's `window_size` (when installed): a
             candidate path, not what the layer runs
  core       the whole core (the sum of the above plus the gate combine)
  fa3_full   FlashAttention-3 full causal attention on the same q/k/v shapes (when installed)

`--variants` runs the Pallas stages once per variant, e.g.
  --variants "base;sel_xla:select.topn=xla;dkv_nt:cmp.dkv_transposed=False"
where a variant is `name[:kernel.field=value,...]` with kernel one of `cmp` (compressed
attention BlockSizes), `select` (select_blocks BlockSizes), `selected` (selected attention
BlockSizes), or `pallas` (a PallasOptions field, e.g. `kernel:pallas.compressed_cudnn=False`).
`--workload coherent` (or trained_fit, trained; bench/workloads.py) forces that selection on the
selected and core stages, e.g. the selected kernel's token tiles on neighbouring queries that
share blocks:
  --stages selected --workload coherent \
  --variants "base;t4:selected.tokens_fwd=4,selected.tokens_dq=4"
Writes `breakdown.csv` and prints a table.

Example (GPU): python bench/breakdown_prefill.py --S_list 8k,64k --out artifacts/breakdown
CPU smoke:     python bench/breakdown_prefill.py --device cpu --preset tiny --dv 16 --S_list 64 \
                   --iters 1 --repeats 1 --warmup 0 --rotate 1 --dtype float32 \
                   --out /tmp/breakdown   (Pallas' interpreter; the FA-3 stages print skipped)
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench import bench_prefill, workloads  # noqa: E402

COLUMNS = ["variant", "stage", "pass", "S", "status", "ms", "ms_min", "ms_max", "note", "device",
           "commit", "workload"]
STAGES = ("compress", "cmp_attn", "select", "selected", "window", "window_fa3", "core",
          "fa3_full")
# kernel -> (PallasOptions field, the kernel's module, whose BlockSizes the field holds)
KERNELS = {"cmp": ("compressed_blocks", "pallas_kernels.compressed_attention"),
           "select": ("select_blocks", "pallas_kernels.select_blocks"),
           "selected": ("selected_blocks", "pallas_kernels.selected_attention")}


def parse_variants(text: str) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """`name[:kernel.field=value,...];...` -> [(name, {kernel: {field: value}})]."""
    variants = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        name, _, assignments = spec.partition(":")
        fields: dict[str, dict[str, Any]] = {}
        for assignment in filter(None, (a.strip() for a in assignments.split(","))):
            key, _, value = assignment.partition("=")
            kernel, _, field = key.partition(".")
            if kernel not in (*KERNELS, "pallas") or not field or not value:
                raise ValueError(f"--variants: {assignment!r} must be kernel.field=value with "
                                 f"kernel in {sorted(KERNELS)} or pallas (a PallasOptions "
                                 f"field)")
            fields.setdefault(kernel, {})[field] = common.parse_literal(value)
        variants.append((name, fields))
    if not variants:
        raise ValueError("--variants names no variant")
    return variants


def pallas_options(fields: dict[str, dict[str, Any]]):
    """The `{"pallas": PallasOptions}` mapping of one variant (kernel defaults elsewhere)."""
    import importlib

    from nsa_jax import PallasOptions

    kwargs = {KERNELS[kernel][0]: importlib.import_module(KERNELS[kernel][1]).BlockSizes(**values)
              for kernel, values in fields.items() if kernel != "pallas"}
    return {"pallas": PallasOptions(**kwargs, **fields.get("pallas", {}))}


def time_pass(fn: Callable, inputs: list[tuple], args, grad: bool) -> dict[str, Any]:
    """Median ms of `fn(*inputs[i])` (forward) or of its vjp (forward+backward) over rotating
    input sets."""
    import jax
    import jax.numpy as jnp

    if grad:
        def run(*xs):
            out, pullback = jax.vjp(fn, *xs)
            return pullback(jax.tree_util.tree_map(jnp.ones_like, out))
    else:
        run = fn
    timing, _ = common.time_jax_fn(run, inputs, iters=args.iters, warmup=args.warmup,
                                   repeats=args.repeats)
    return {"status": common.OK, **timing.fields()}


def stage_functions(cfg, options) -> dict[str, tuple[Callable, Callable, bool]]:
    """stage -> (function, inputs picker from the prepared arrays, differentiable)."""
    import nsa_jax

    backend = ("pallas", "xla")
    kw = dict(backend=backend, options=options)
    core, _ = bench_prefill.nsa_jax_core(cfg, "pallas", options=options)

    def compress(k_in, v_in, cmp_params):
        return (nsa_jax.compress_kv(k_in, cmp_params.get("cmp_k"), cfg, **kw),
                nsa_jax.compress_kv(v_in, cmp_params.get("cmp_v"), cfg, **kw))

    def cmp_attn(q, k_cmp, v_cmp):
        return nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True, **kw)

    def select(q, k_cmp, lse):
        return nsa_jax.select_blocks(q, k_cmp, cfg, lse=lse, **kw)

    def selected(q, k, v, block_idx):
        return nsa_jax.selected_attention(q, k, v, block_idx, cfg.sel_block, **kw)

    def window(q, k, v):
        return nsa_jax.sliding_window_attention(q, k, v, cfg.window, **kw)

    def window_fa3(q, k, v):
        try:
            from flash_attn3_jax import flash_mha
        except ImportError as exc:
            raise common.Skip(f"flash_attn3_jax not importable ({exc})") from None
        return flash_mha(q, k, v, is_causal=True, window_size=(cfg.window - 1, 0))

    return {
        "window_fa3": (window_fa3, lambda a: (a["q"], a["k_win"], a["v_win"]), True),
        "compress": (compress, lambda a: (a["k_cmp_in"], a["v_cmp_in"], a["cmp_params"]), True),
        "cmp_attn": (cmp_attn, lambda a: (a["q"], a["k_cmp"], a["v_cmp"]), True),
        "select": (select, lambda a: (a["q"], a["k_cmp"], a["lse"]), False),
        "selected": (selected, lambda a: (a["q"], a["k_sel"], a["v_sel"], a["block_idx"]), True),
        "window": (window, lambda a: (a["q"], a["k_win"], a["v_win"]), True),
        "core": (core, lambda a: a["core_inputs"], True),
    }


def prepare(cfg, args, S: int, seed: int, options, forced=None) -> dict[str, Any]:
    """One input set: the core's inputs and every intermediate a later stage reads. forced: the
    workload's block_idx `[B, S, G, n_sel]` (None: the inputs' own selection)."""
    import jax
    import nsa_jax

    (q, k_cmp_in, v_cmp_in, k_sel, v_sel, k_win, v_win, gates, cmp_params), _ = \
        bench_prefill.nsa_jax_inputs(cfg, args, S, shared_kv=False)(seed)
    kw = dict(backend=("pallas", "xla"), options=options)
    k_cmp = nsa_jax.compress_kv(k_cmp_in, cmp_params.get("cmp_k"), cfg, **kw)
    v_cmp = nsa_jax.compress_kv(v_cmp_in, cmp_params.get("cmp_v"), cfg, **kw)
    _, lse = nsa_jax.compressed_attention(q, k_cmp, v_cmp, cfg, return_lse=True, **kw)
    block_idx = nsa_jax.select_blocks(q, k_cmp, cfg, lse=lse, **kw)
    # A forced workload replaces the selection in the selected and core stages (as the core's
    # `block_idx=` does); the select stage still ranks the random inputs' blocks.
    if forced is not None:
        block_idx = jax.numpy.asarray(forced, jax.numpy.int32)
    jax.block_until_ready(block_idx)
    return dict(q=q, k_cmp_in=k_cmp_in, v_cmp_in=v_cmp_in, k_sel=k_sel, v_sel=v_sel, k_win=k_win,
                v_win=v_win, cmp_params=cmp_params, k_cmp=k_cmp, v_cmp=v_cmp, lse=lse,
                block_idx=block_idx,
                core_inputs=(q, k_cmp_in, v_cmp_in, k_sel, v_sel, k_win, v_win, gates,
                             cmp_params) + (() if forced is None else (block_idx,)))


def run(args) -> list[dict[str, Any]]:
    import jax

    cfg = args.cfg
    device = args.device_label = common.device_name(args.device)
    commit = common.git_commit()[:12]
    records = []
    for S in args.S:
        forced = workloads.prefill_block_idx(args, cfg, args.B, S)  # drawn once for the variants
        for name, fields in args.variants:
            options = pallas_options(fields)
            try:
                sets = [prepare(cfg, args, S, seed, options, forced)
                        for seed in range(args.rotate)]
            except Exception as exc:  # a variant that does not compile is a row, not a crash
                record = dict(variant=name, stage="prepare", S=S, device=device, commit=commit,
                              workload=args.workload,
                              status=common.classify_exception(exc), note=common.short_error(exc),
                              **{"pass": "fwd"})
                records.append(record)
                print(_line(record), flush=True)
                continue
            functions = stage_functions(cfg, options)
            for stage in args.stages:
                if stage == "fa3_full":
                    if name != args.variants[0][0]:
                        continue  # once per S
                    records += _fa3(args, S, device, commit)
                    continue
                fn, pick, grad = functions[stage]
                inputs = [pick(a) for a in sets]
                passes = ("fwd", "fwd_bwd") if grad else ("fwd",)
                for pass_name in passes:
                    record = dict(variant=name, stage=stage, S=S, device=device, commit=commit,
                                  workload=args.workload, **{"pass": pass_name})
                    try:
                        record.update(time_pass(fn, inputs, args, pass_name == "fwd_bwd"))
                    except common.Skip as why:
                        record.update(status=common.SKIPPED, note=f"skipped: {why}")
                    except Exception as exc:  # a failed variant is a row, not a crash
                        record.update(status=common.classify_exception(exc),
                                      note=common.short_error(exc))
                    records.append(record)
                    print(_line(record), flush=True)
            del sets
            jax.clear_caches()
    return records


def _fa3(args, S, device, commit) -> list[dict[str, Any]]:
    records = []
    for pass_name in ("fwd", "fwd_bwd"):
        record = dict(variant="-", stage="fa3_full", S=S, device=device, commit=commit,
                      workload=args.workload, **{"pass": pass_name})
        try:
            rows = bench_prefill.run_fa3(args, S, "fa3_full")
            match = [r for r in rows if r["pass"] == pass_name][0]
            record.update(status=match["status"], ms=match.get("ms"), ms_min=match.get("ms_min"),
                          ms_max=match.get("ms_max"), note=match.get("note", ""))
        except common.Skip as why:
            record.update(status=common.SKIPPED, note=f"skipped: {why}")
        except Exception as exc:
            record.update(status=common.classify_exception(exc), note=common.short_error(exc))
        records.append(record)
        print(_line(record), flush=True)
        if record["status"] != common.OK:
            break
    return records


def _line(r) -> str:
    ms = f"{r['ms']:.3f} ms" if r.get("ms") is not None else r.get("status")
    return f"S={r['S']:>7} {r['variant']:>12} {r['stage']:>9} {r['pass']:>7}: {ms} {r.get('note') or ''}"


def build_parser() -> argparse.ArgumentParser:
    parser = bench_prefill.build_parser()
    parser.description, parser.epilog = __doc__.split("\n", 1)
    parser.set_defaults(S_list="64k", out="artifacts/breakdown", iters=10, repeats=3, rotate=2)
    parser.add_argument("--variants", default="base", help="see the module docstring")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma subset of {','.join(STAGES)}")
    return parser


def main(argv=None) -> int:
    args = common.finish_args(build_parser().parse_args(argv))
    args.S = common.parse_int_list(args.S_list, "--S_list")
    args.variants = parse_variants(args.variants)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"--stages has unknown stages {unknown}; known: {list(STAGES)}")
    workloads.check_workload_args(args)
    common.setup_device(args.device)
    os.makedirs(args.out, exist_ok=True)
    records = run(args)
    path = os.path.join(args.out, "breakdown.csv")
    common.write_csv(path, records, COLUMNS)
    rows = [(r["S"], r["variant"], r["stage"], r["pass"],
             f"{r['ms']:.3f}" if r.get("ms") is not None else r["status"]) for r in records]
    print(common.format_table(rows, ["S", "variant", "stage", "pass", "ms"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
