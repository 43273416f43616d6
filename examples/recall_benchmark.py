"""A recall benchmark: NSA against full and window attention on needle and MQAR at T 2048.

    PYTHONPATH=. python examples/recall_benchmark.py --out /tmp/rb         # all models, seeds 1-5
    PYTHONPATH=. python examples/recall_benchmark.py --models full --seeds 1 --out /tmp/rb
    PYTHONPATH=. python examples/recall_benchmark.py --report_only --out /tmp/rb   # report again
    PYTHONPATH=. python examples/recall_benchmark.py --step_times 512,2048 \
        --backends "pallas,xla;xla" --out /tmp/rb_steps              # ms per step, no training
    PYTHONPATH=. python examples/recall_benchmark.py --preset cpu --steps 300 --seeds 1 \
        --out /tmp/rb_cpu                                                 # CPU, T 256

One model per (model, seed) is trained on associative recall whose sequences hold 1, 4 or 16
key / value pairs (`--pairs`, drawn per sequence; every pair of a sequence is asked at the end
in random order, so the needle is the one-pair case), then evaluated on each count separately
at the full length: `needle`, `mqar4`, `mqar16`. Sequences share one format: the last
2 x max(pairs) tokens are query slots, the asked queries take the last of them and filler the
rest, and every key lies beyond the window and NSA's forced blocks of every slot.

Models (`MODELS`): `full` (causal attention), `window` (NSA's sliding window alone), `nsa`
(the library's defaults), `nsa_aligned` (the selection-alignment recipe of docs/API.md: a dense
warm-up for `--dense_frac` of the steps, then sparse, `--kl_weight` x the layers' mean
`nsa_jax.selection_alignment_loss` throughout), `nsa_aligned_s16` (the same with the loss over
every 16th query, its cheaper form at long T), and `nsa_warmup` (the warm-up without the loss,
its ablation). Every model of a seed starts from the same draw (`train_recall.init_model`,
paired) and sees the same batches. Every model has a token shift before each attention
(`train_recall.ModelConfig.token_shift`; `--no_token_shift`: none): a key vector can carry the
token before it, so recall is one attention hop, and full attention solves every task in the
gpu schedule (examples/RECALL_NOTES.md).

The loss is the mean over sequences of the mean cross-entropy of their answers. The curriculum
(`--curriculum`, as train_recall's) trains short sequences first with `--tokens_per_step`
tokens per step (batch = tokens / T), so most steps are cheap.

Runs go to `--jobs` worker processes at a time (on a GPU host spread over its GPUs, each
process holding its share of GPU memory); each writes `<out>/<model>_s<seed>/` (`curves.csv`,
`run.json`, `log.txt`). Then the report: `results.md` (accuracy per model and task, mean and
range over seeds and the gap to full attention on the same seeds; when runs stopped at
different steps, the same at the last evaluation all of them reached; per run; and how much
neighbouring queries' selections overlap in the trained NSA models, the statistic of the
prefill benchmark's selection workloads, `bench/workloads.py`),
`summary.csv` (a row per run) and `curves.png` (accuracy per task, alignment KL and selection
hit rates against steps).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import glob
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (attention, alignment recipe: None, "kl" (warm-up + loss) or "warmup" (warm-up only),
# the loss's query stride: every s-th query enters it, `nsa_jax.AlignmentOptions.query_stride`)
MODELS = {"full": ("full", None, 1), "window": ("window", None, 1), "nsa": ("nsa", None, 1),
          "nsa_aligned": ("nsa", "kl", 1), "nsa_aligned_s16": ("nsa", "kl", 16),
          "nsa_warmup": ("nsa", "warmup", 1)}
DEFAULT_MODELS = "full,window,nsa,nsa_aligned"
TASK_NAMES = {1: "needle"}

# The benchmark's training schedule on top of train_recall's presets (their model sizes): the
# gpu one is the setting of examples/RECALL_NOTES.md, where full attention with the token shift
# (on unless --no_token_shift) solves every task on every seed tried.
SCHEDULES = {
    "gpu": dict(steps=4500, curriculum="512:2250,1024:3375", lr=1e-3, tokens_per_step=32768,
                eval_every=250, eval_batch=128),
    "cpu": dict(steps=600, curriculum="128:300", lr=3e-3, tokens_per_step=4096, eval_every=100,
                eval_batch=64),
    "smoke": dict(steps=6, curriculum="", lr=1e-2, tokens_per_step=512, eval_every=3,
                  eval_batch=8),
}


def task_name(pairs: int) -> str:
    return TASK_NAMES.get(pairs, f"mqar{pairs}")


def parse_pairs(text: str) -> tuple[int, ...]:
    try:
        pairs = tuple(sorted({int(p) for p in text.split(",") if p.strip()}))
    except ValueError:
        pairs = ()
    if not pairs or pairs[0] < 1:
        raise ValueError(f"--pairs ({text!r}) must be a comma list of positive pair counts")
    return pairs


def parse_seeds(text: str) -> list[int]:
    """"1-5" or "1,3,7" -> seeds."""
    seeds: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        seeds = []
    if not seeds:
        raise ValueError(f"--seeds ({text!r}) must be like 1-5 or 1,3,7")
    return seeds


def parse_steps(text: str, flag: str = "--report_steps") -> tuple:
    """'2000,3500' -> (2000, 3500); '' -> ()."""
    try:
        steps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        steps = (0,)
    if any(step < 1 for step in steps):
        raise ValueError(f"{flag} ({text!r}) must be positive integers like 2000,3500")
    return steps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {list(MODELS)}")
    parser.add_argument("--seeds", default="1-5", help="e.g. 1-5 or 1,3,7")
    parser.add_argument("--pairs", default="1,4,16",
                        help="pair counts drawn per training sequence and evaluated one by one")
    parser.add_argument("--tokens_per_step", type=int, default=None,
                        help="tokens per training step: batch = tokens / T (schedule's value)")
    parser.add_argument("--dense_frac", type=float, default=0.3,
                        help="nsa_aligned / nsa_warmup: share of the steps in the dense warm-up")
    parser.add_argument("--kl_weight", type=float, default=1.0)
    parser.add_argument("--kl_mode", choices=("dense", "sparse"), default="dense",
                        help="nsa_aligned: the sparse stage's target (docs/API.md)")
    parser.add_argument("--no_token_shift", action="store_true",
                        help="models without train_recall's token shift before each attention "
                             "(ModelConfig.token_shift; then full attention learns MQAR slowly, "
                             "examples/RECALL_NOTES.md)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--gpus", default=None,
                        help="comma list of GPU ids the jobs spread over (default: every GPU "
                             "nvidia-smi lists; none: the workers share the default device)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the runs in --out that their --budget_s stopped, from "
                             "the state each saved (state.pkl); finished runs are left as they "
                             "are, runs without a saved state start again")
    parser.add_argument("--report_only", action="store_true",
                        help="only the report from the runs already in --out")
    parser.add_argument("--report_steps", default="",
                        help="comma list of steps: the report also compares the runs "
                             "evaluated at each (for runs stopped at different steps)")
    parser.add_argument("--step_times", default=None, metavar="LENGTHS",
                        help="instead of training: time one training step of each model at "
                             "these T (e.g. 512,2048) into <out>/step_times.csv")
    parser.add_argument("--backends", default="pallas,xla",
                        help="--step_times: the NSA dispatch backends to time, ';' between "
                             "them (e.g. 'pallas,xla;xla')")
    parser.add_argument("--export_selection", default="", metavar="LENGTHS",
                        help="NSA runs, after training: save the trained layers' selection on "
                             "one MQAR sequence of each of these T (e.g. 8192,16384) as "
                             "selection_T<T>.npy in the run's folder, int32 [1, T, layers x G, "
                             "--export_n_sel]: a `trained` workload of the prefill and decode "
                             "benches (bench/workloads.py)")
    parser.add_argument("--export_n_sel", type=int, default=16,
                        help="--export_selection: blocks each query selects (n_sel has no "
                             "parameters; 16: the benches' preset)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # a worker: model:seed
    args, rest = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs ({args.jobs}) must be >= 1")
    if not 0.0 <= args.dense_frac <= 1.0:
        parser.error(f"--dense_frac ({args.dense_frac}) must lie in [0, 1]")
    if args.export_n_sel < 1:
        parser.error(f"--export_n_sel ({args.export_n_sel}) must be >= 1")
    try:
        args.pairs = parse_pairs(args.pairs)
        args.seed_list = parse_seeds(args.seeds)
        args.report_steps = parse_steps(args.report_steps)
        args.step_lengths = parse_steps(args.step_times or "", "--step_times")
        args.export_lengths = parse_steps(args.export_selection, "--export_selection")
    except ValueError as exc:
        parser.error(str(exc))
    args.model_list = [m for m in args.models.split(",") if m]
    for m in args.model_list:
        if m not in MODELS:
            parser.error(f"--models: {m!r} is not one of {list(MODELS)}")
    preset = _flag_value(rest, "preset") or "gpu"
    schedule = dict(SCHEDULES.get(preset, SCHEDULES["gpu"]))
    given = {a.lstrip("-").split("=")[0] for a in rest if a.startswith("--")}
    if "steps" in given and "curriculum" not in given:
        # The schedule's stages scaled to the given --steps (as train_recall does its preset's).
        from examples import train_recall

        steps = int(_flag_value(rest, "steps"))
        T = int(_flag_value(rest, "T") or train_recall.PRESETS.get(
            preset, train_recall.PRESETS["gpu"])["T"])
        schedule["curriculum"] = train_recall.fit_curriculum(schedule["curriculum"],
                                                             schedule["steps"], steps, T)
    extra = [x for k, v in schedule.items() if k != "tokens_per_step" and k not in given
             for x in (f"--{k}", str(v))]
    if not args.no_token_shift and "token_shift" not in given:
        extra.append("--token_shift")
    if args.tokens_per_step is None:
        args.tokens_per_step = schedule["tokens_per_step"]
    args.passthrough = rest
    return args, rest + extra


def _flag_value(argv: list[str], name: str) -> Optional[str]:
    """The value of `--name v` or `--name=v` in argv (the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def recall_args(rest: list[str], out: str):
    """train_recall's arguments (sizes, lr, steps, curriculum, eval settings) for one run."""
    from examples import train_recall

    return train_recall.parse_args(["--out", out, "--models", "full", "--tasks", "needle",
                                    "--gen_tokens", "0"] + rest)


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------
def mixed_batch(rng, pairs, vocab, B: int, T: int, cfg, slots: int) -> dict:
    """B sequences, each with a pair count drawn from `pairs`, in the shared format: tokens
    `[B, T]`, answers / key_pos `[B, slots]` (-1 where a slot holds filler)."""
    import numpy as np

    from examples import train_recall

    counts = rng.choice(np.asarray(pairs), size=B)
    tokens = np.empty((B, T), np.int32)
    answers = np.full((B, slots), -1, np.int32)
    key_pos = np.full((B, slots), -1, np.int32)
    for p in pairs:
        rows = np.flatnonzero(counts == p)
        if rows.size == 0:
            continue
        task = train_recall.Task(task_name(p), p, p, slots)
        part = train_recall.make_batch(rng, task, vocab, rows.size, T, cfg)
        tokens[rows] = part["tokens"]
        answers[rows, slots - p:] = part["answers"]
        key_pos[rows, slots - p:] = part["key_pos"]
    return dict(tokens=tokens, answers=answers, key_pos=key_pos)


def mixed_loss(params, tokens, answers, kl_weight, *, mc, slots, alignment):
    """Mean over sequences of the mean cross-entropy over their answers (slots with answer -1
    hold filler), plus kl_weight x the layers' mean alignment loss when `alignment` is given.
    -> (loss, (task loss, KL, accuracy over the answers))."""
    import jax
    import jax.numpy as jnp

    from examples import train_aligned, train_recall

    h, layers = train_recall.forward(params, tokens, mc, collect=True)
    T = tokens.shape[1]
    logits = train_recall.logits_at(params, h[:, T - 2 * slots::2]).astype(jnp.float32)
    valid = answers >= 0
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, jnp.maximum(answers, 0)[..., None], axis=-1)[..., 0]
    per_row = jnp.sum(nll * valid, -1) / jnp.maximum(jnp.sum(valid, -1), 1)
    task_loss = per_row.mean()
    correct = (jnp.argmax(logits, -1) == answers) & valid
    accuracy = correct.sum() / jnp.maximum(valid.sum(), 1)
    kl = jnp.zeros((), jnp.float32)
    if alignment is not None:
        kl = train_aligned.alignment_kl(params, layers, mc, alignment)
    return task_loss + kl_weight * kl, (task_loss, kl, accuracy)


@functools.lru_cache(maxsize=None)
def _train_step():
    import jax

    from examples import train_recall

    @functools.partial(jax.jit, static_argnames=("mc", "slots", "alignment"))
    def step(params, opt_state, tokens, answers, lr, kl_weight, *, mc, slots, alignment):
        (_, stats), grads = jax.value_and_grad(mixed_loss, has_aux=True)(
            params, tokens, answers, kl_weight, mc=mc, slots=slots, alignment=alignment)
        updates, opt_state = train_recall.OPTIMIZER.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, stats
    return step


def check_lengths(stages, T: int, pairs, cfg) -> None:
    """Every pair count must fit beyond the window and the forced blocks at every length the
    curriculum trains on (checked before the first step)."""
    from examples import train_recall

    for length in sorted({t for t, _ in stages} | {T}):
        for p in pairs:
            try:
                train_recall.pair_region(train_recall.Task(task_name(p), p, p, max(pairs)),
                                         length, cfg)
            except ValueError as exc:
                raise ValueError(f"--curriculum / --T / --pairs: {p} pairs at T = {length}: "
                                 f"{exc}") from None


def stage(model: str, mc, T: int, dense: bool, kl_mode: str):
    """A training step's model config and alignment options at length T: in the dense warm-up
    the selected branch attends to every block; the recipe's loss is on in both stages.
    -> (ModelConfig, AlignmentOptions or None)."""
    import nsa_jax

    _, recipe, query_stride = MODELS[model]
    stage_mc = (dataclasses.replace(mc, nsa=nsa_jax.dense_warmup_config(mc.nsa, T))
                if dense else mc)
    alignment = (nsa_jax.AlignmentOptions(mode="dense" if dense else kl_mode,
                                          query_stride=query_stride)
                 if recipe == "kl" else None)
    return stage_mc, alignment


def build_model(model: str, rargs, seed: int, slots: int):
    """`model`'s ModelConfig (train_recall's arguments `rargs`), the vocabulary with room for
    `slots` query keys, the paired initial parameters of `seed` and their optimizer state.
    -> (mc, vocab, params, opt_state)."""
    import jax

    from examples import train_recall

    rargs.models = MODELS[model][0]
    (run,), vocab = train_recall.build_runs(rargs)
    vocab = dataclasses.replace(vocab, n_keys=max(vocab.n_keys, slots))
    params = train_recall.init_model(jax.random.PRNGKey(seed), run.mc,
                                     dataclasses.replace(run.variant, dense_init=True))
    return run.mc, vocab, params, train_recall.OPTIMIZER.init(params)


def train_one(model: str, seed: int, args, rest: list[str], out: str) -> dict:
    """Train `model` with `seed`; write curves.csv and run.json into `out`. -> the run's
    summary (final accuracy per task, KL, hit rates, time)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import common
    from examples import train_recall

    os.makedirs(out, exist_ok=True)
    rargs = recall_args(rest, out)
    attention, recipe, query_stride = MODELS[model]
    slots = max(args.pairs)
    mc, vocab, params, opt_state = build_model(model, rargs, seed, slots)
    stages = train_recall.parse_curriculum(rargs.curriculum, rargs.steps)
    check_lengths(stages, rargs.T, args.pairs, mc.nsa)
    dense_steps = int(round(args.dense_frac * rargs.steps)) if recipe else 0
    data_rng = np.random.default_rng(seed)
    evals = {}
    for p in args.pairs:
        task = train_recall.Task(task_name(p), p, p, slots)
        batch = train_recall.make_batch(np.random.default_rng(10_000 + 100 * seed + p), task,
                                        vocab, rargs.eval_batch, rargs.T, mc.nsa)
        evals[task] = [jnp.asarray(batch[k]) for k in ("tokens", "answers", "key_pos")]
    step_fn = _train_step()
    rows, t_begin, train_s, compile_s, timed = [], time.perf_counter(), 0.0, 0.0, 0
    losses, kls, accs, prev_key = [], [], [], None
    start = 0
    state_path = os.path.join(out, STATE_FILE)
    if args.resume and os.path.exists(state_path):
        state = load_state(state_path)
        start, rows, train_s, compile_s, timed = (state["step"], state["rows"], state["train_s"],
                                                  state["compile_s"], state["timed"])
        params = jax.tree_util.tree_map(jnp.asarray, state["params"])
        opt_state = jax.tree_util.tree_map(jnp.asarray, state["opt_state"])
        data_rng.bit_generator.state = state["data_rng"]
        print(f"resumed at step {start}", flush=True)
    if start >= rargs.steps:
        raise ValueError(f"{state_path}: the run already has its {rargs.steps} steps")
    for step in range(start, rargs.steps):
        T = train_recall.length_at(step, stages, rargs.T)
        dense = step < dense_steps
        stage_mc, alignment = stage(model, mc, T, dense, args.kl_mode)
        B = max(1, args.tokens_per_step // T)
        batch = mixed_batch(data_rng, args.pairs, vocab, B, T, mc.nsa, slots)
        lr = train_recall.learning_rate(step, rargs.lr, rargs.warmup, rargs.steps)
        key = (T, dense)
        t0 = time.perf_counter()
        params, opt_state, (loss, kl, acc) = step_fn(
            params, opt_state, batch["tokens"], batch["answers"], jnp.float32(lr),
            jnp.float32(args.kl_weight), mc=stage_mc, slots=slots, alignment=alignment)
        if key != prev_key:  # a new shape or stage compiles: kept out of the training time
            loss.block_until_ready()
            compile_s += time.perf_counter() - t0
            prev_key = key
        else:
            train_s += time.perf_counter() - t0
            timed += 1
        losses.append(loss)
        kls.append(kl)
        accs.append(acc)
        last = step + 1 == rargs.steps or time.perf_counter() - t_begin > rargs.budget_s
        if (step + 1) % rargs.eval_every == 0 or last:
            t_sync = time.perf_counter()
            jax.block_until_ready(params)
            train_s += time.perf_counter() - t_sync
            row = dict(model=model, seed=seed, step=step + 1, T=T,
                       stage="dense" if dense else "sparse", train_s=round(train_s, 3),
                       train_loss=float(jnp.mean(jnp.stack(losses))),
                       kl=float(jnp.mean(jnp.stack(kls))),
                       train_acc=float(jnp.mean(jnp.stack(accs))))
            losses, kls, accs = [], [], []
            for task, arrays in evals.items():
                stats = train_recall.in_chunks(
                    functools.partial(train_recall.evaluate, params, mc=mc, task=task,
                                      probe=False), arrays, rargs.eval_chunk)
                row[f"acc_{task.name}"] = stats["acc"]
                for i in range(rargs.n_layers):
                    if f"l{i}_hit" in stats:
                        row[f"l{i}_hit_{task.name}"] = stats[f"l{i}_hit"]
            rows.append(row)
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()), flush=True)
            if not math.isfinite(row["train_loss"]) or last:
                break
    final = rows[-1]
    if final["step"] < rargs.steps and math.isfinite(final["train_loss"]):
        # Stopped by the budget: what --resume continues from.
        save_state(state_path, dict(step=final["step"], rows=rows, train_s=train_s,
                                    compile_s=compile_s, timed=timed,
                                    params=jax.device_get(params),
                                    opt_state=jax.device_get(opt_state),
                                    data_rng=data_rng.bit_generator.state))
    elif os.path.exists(state_path):
        os.remove(state_path)
    summary = dict(model=model, seed=seed, steps=final["step"], train_s=final["train_s"],
                   ms_per_step=1e3 * final["train_s"] / max(1, timed),
                   compile_s=round(compile_s, 2), kl=final["kl"] if recipe == "kl" else None,
                   finite=math.isfinite(final["train_loss"]),
                   **{k: v for k, v in final.items() if k.startswith("acc_") or "_hit_" in k})
    if attention == "nsa":
        tokens = evals[max(evals, key=lambda task: task.n_pairs)][0]
        summary.update(selection_overlap(params, tokens[:OVERLAP_ROWS], mc))
    common.write_csv(os.path.join(out, "curves.csv"), rows, list(rows[-1]))
    exports = {}

    def write_record():
        common.write_environment(os.path.join(out, "run.json"), dict(
            summary=summary, model=model, seed=seed, recipe=recipe, pairs=list(args.pairs),
            tokens_per_step=args.tokens_per_step, dense_steps=dense_steps,
            kl_weight=args.kl_weight if recipe == "kl" else None,
            kl_mode=args.kl_mode if recipe == "kl" else None,
            query_stride=query_stride if recipe == "kl" else None, recall_args=vars(rargs),
            nsa=dataclasses.asdict(mc.nsa), exported_selections=exports))

    # The run is recorded before its exports (a long export stopped by the launcher's time
    # limit keeps the trained run) and again after each.
    write_record()
    if attention == "nsa":
        for T in args.export_lengths:
            exports[f"T{T}"] = export_selection(params, mc, vocab, T, args.export_n_sel, slots,
                                                seed, out)
            write_record()
    return summary


def step_times(args, rest: list[str], backends: list[str], lengths: list[int],
               repeats: int = 20) -> list[dict]:
    """ms per training step of each model in --models (every NSA `backends` entry for the NSA
    ones; a recipe's dense warm-up and sparse stage apart) at each of `lengths` with the
    benchmark's tokens per step, the runs' own step function (compile excluded; the mean of
    `repeats` steps after one). Writes `<out>/step_times.csv`; -> the rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import common

    rows, step_fn, slots = [], _train_step(), max(args.pairs)
    for model in args.model_list:
        attention, recipe, _ = MODELS[model]
        for backend in backends if attention == "nsa" else backends[:1]:
            mc, vocab, params, opt_state = build_model(
                model, recall_args(rest + ["--backend", backend], args.out), 0, slots)
            rng = np.random.default_rng(0)
            for T in lengths:
                for dense in (True, False) if recipe else (False,):
                    stage_mc, alignment = stage(model, mc, T, dense, args.kl_mode)
                    B = max(1, args.tokens_per_step // T)
                    batch = mixed_batch(rng, args.pairs, vocab, B, T, mc.nsa, slots)
                    inputs = (jnp.asarray(batch["tokens"]), jnp.asarray(batch["answers"]),
                              jnp.float32(1e-3), jnp.float32(args.kl_weight))

                    def step(p, o):
                        return step_fn(p, o, *inputs, mc=stage_mc, slots=slots,
                                       alignment=alignment)

                    t0 = time.perf_counter()
                    p, o, stats = step(params, opt_state)
                    jax.block_until_ready(stats)
                    compile_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        p, o, stats = step(p, o)
                    jax.block_until_ready(stats)
                    row = dict(model=model, backend=",".join(mc.backend) if attention == "nsa"
                               else "-", T=T, batch=B, stage="dense" if dense else "sparse",
                               ms_per_step=round((time.perf_counter() - t0) / repeats * 1e3, 3),
                               compile_s=round(compile_s, 1))
                    print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
                    rows.append(row)
    common.write_csv(os.path.join(args.out, "step_times.csv"), rows, list(rows[0]))
    return rows


OVERLAP_ROWS = 16  # evaluation sequences whose selections give the overlap statistics


def selection_overlap(params, tokens, mc) -> dict:
    """How much neighbouring queries' selections overlap in the trained model, per layer, on
    `tokens [B, T]`: `l{i}_sel_shared`, `l{i}_sel_jaccard` and `l{i}_sel_tile_union`
    (`bench.workloads.overlap_stats`, the statistics of the prefill benchmark's selection
    workloads), over the queries past the first n_sel blocks (before them every eligible block
    is selected)."""
    from bench import workloads

    first = mc.nsa.n_sel * mc.nsa.sel_block
    out = {}
    for i, block_idx in enumerate(layer_selections(params, tokens, mc)):
        stats = workloads.overlap_stats(block_idx, first=first)
        out.update({f"l{i}_sel_{name}": value for name, value in stats.items()})
    return out


def layer_selections(params, tokens, mc) -> list:
    """Each NSA layer's selection in the model of `mc` on `tokens [B, T]`: a list of int32
    `[B, T, G, n_sel]` NumPy arrays (the layers' `aux["block_idx"]`)."""
    import jax
    import numpy as np

    from examples import train_recall

    @jax.jit
    def selections(params, tokens):
        _, layers = train_recall.forward(params, tokens, mc, collect=True)
        return [aux["block_idx"] for _, aux in layers]

    return [np.asarray(b) for b in selections(params, tokens)]


def export_selection(params, mc, vocab, T: int, n_sel: int, slots: int, seed: int,
                     out: str) -> dict:
    """Save the trained NSA layers' selection on one MQAR sequence of T tokens (the most pairs
    trained, the evaluation's format) with `n_sel` blocks a query, as `<out>/selection_T<T>.npy`
    int32 `[1, T, layers x G, n_sel]` (layer-major: layer i's KV groups at i*G ...), a `trained`
    workload for the benches (`bench.workloads.load_selection`). -> its file name and the
    overlap statistics past the first n_sel blocks."""
    import numpy as np

    from bench import workloads
    from examples import train_recall

    wide = dataclasses.replace(mc, nsa=mc.nsa.replace(n_sel=n_sel))
    task = train_recall.Task(task_name(slots), slots, slots, slots)
    batch = train_recall.make_batch(np.random.default_rng(20_000 + seed), task, vocab, 1, T,
                                    mc.nsa)
    idx = np.concatenate(layer_selections(params, batch["tokens"], wide), axis=2)
    name = f"selection_T{T}.npy"
    workloads.save_selection(os.path.join(out, name), idx)
    stats = workloads.overlap_stats(idx, first=n_sel * mc.nsa.sel_block)
    return dict(file=name, n_sel=n_sel, **stats)


STATE_FILE = "state.pkl"  # a stopped run's parameters, optimizer and data stream


def save_state(path: str, state: dict) -> None:
    import pickle

    with open(path + ".tmp", "wb") as f:
        pickle.dump(state, f)
    os.replace(path + ".tmp", path)


def load_state(path: str) -> dict:
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def finished(out: str, steps: int) -> bool:
    """Whether the run in `out` has all its `steps` (its run.json says so)."""
    try:
        with open(os.path.join(out, "run.json")) as f:
            return json.load(f)["summary"]["steps"] >= steps
    except (OSError, KeyError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Many runs
# ---------------------------------------------------------------------------------------------
def visible_gpus(text: Optional[str]) -> list[str]:
    if text is not None:
        return [g for g in text.split(",") if g and g != "none"]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU")]


MIN_RUN_S = 60.0  # a run needs about this long to compile and reach its first steps


class GpuSlots:
    """Which GPU a new worker takes: the one running the fewest workers now (the first such in
    the list), so that a GPU freed by short runs gets the next one. Thread-safe; no GPUs: None."""

    def __init__(self, gpus: list[str]):
        self.running = {g: 0 for g in gpus}
        self.lock = threading.Lock()

    def take(self) -> Optional[str]:
        with self.lock:
            if not self.running:
                return None
            gpu = min(self.running, key=self.running.get)
            self.running[gpu] += 1
            return gpu

    def give_back(self, gpu: Optional[str]) -> None:
        if gpu is not None:
            with self.lock:
                self.running[gpu] -= 1


def launch(args, rest: list[str]) -> list[str]:
    """Every (model, seed) run in a worker process, `--jobs` at a time, spread over the GPUs.
    -> the failures (one line each)."""
    from bench import common

    # The costliest models first, so that the last runs to start are short ones.
    cost = {m: i for i, m in enumerate(("nsa_aligned", "nsa_aligned_s16", "nsa_warmup", "nsa",
                                        "full", "window"))}
    runs = sorted(((m, s) for s in args.seed_list for m in args.model_list),
                  key=lambda run: (cost[run[0]], run[1]))
    rargs = recall_args(rest, args.out)
    if args.resume:
        runs = [(m, s) for m, s in runs
                if not finished(os.path.join(args.out, f"{m}_s{s}"), rargs.steps)]
    gpus = visible_gpus(args.gpus)
    per_gpu = math.ceil(args.jobs / max(1, len(gpus)))
    script = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(script))
    slots = GpuSlots(gpus)
    # --budget_s bounds the whole launch: a worker that starts late gets what is left of it,
    # and where the budget was at least MIN_RUN_S, one with less than that left is not started
    # (--resume starts it later).
    budget, t_start = rargs.budget_s, time.perf_counter()

    def work(model: str, seed: int) -> Optional[str]:
        left = max(0.0, budget - (time.perf_counter() - t_start))
        if budget >= MIN_RUN_S > left:
            print(f"{model} seed {seed}: not started, {left:.0f} s of --budget_s left",
                  flush=True)
            return None
        out = os.path.join(args.out, f"{model}_s{seed}")
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH")])))
        gpu = slots.take()
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
            # Each worker holds its share of the card instead of XLA's default 75%.
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / per_gpu:.3f}")
        argv = [sys.executable, script, "--run", f"{model}:{seed}", "--out", out,
                "--pairs", ",".join(map(str, args.pairs)),
                "--tokens_per_step", str(args.tokens_per_step),
                "--dense_frac", str(args.dense_frac), "--kl_weight", str(args.kl_weight),
                "--kl_mode", args.kl_mode, "--export_selection", args.export_selection,
                "--export_n_sel", str(args.export_n_sel)] + (
                    ["--resume"] if args.resume else []) + rest + [
                "--budget_s", f"{left:.1f}"]
        try:
            with open(os.path.join(out, "log.txt"), "a" if args.resume else "w") as log:
                rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=env).returncode
        finally:
            slots.give_back(gpu)
        if rc != 0:
            with open(os.path.join(out, "log.txt")) as f:
                tail = f.read()[-300:].replace("\n", " ")
            return f"{model} seed {seed}: exit {rc}: {tail}"
        return None

    failures = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(work, m, s) for m, s in runs]
        for future in common.progress(concurrent.futures.as_completed(futures),
                                      total=len(futures), desc="recall runs"):
            if future.result():
                failures.append(future.result())
                print(failures[-1], file=sys.stderr, flush=True)
    return failures


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def load_runs(out: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "*", "run.json"))):
        with open(path) as f:
            record = json.load(f)
        from bench import common

        curves = common.read_csv(os.path.join(os.path.dirname(path), "curves.csv"))
        record["curves"] = [{k: common.to_float(v) if k not in ("model", "stage") else v
                             for k, v in r.items()} for r in curves]
        runs.append(record)
    return runs


def at_step(run: dict, step: Optional[int] = None) -> dict:
    """The run's last evaluation at or before `step` (None: its last)."""
    rows = [c for c in run["curves"] if step is None or c["step"] <= step]
    if not rows:
        raise ValueError(f"{run['model']} seed {run['seed']} has no evaluation by step {step}")
    return rows[-1]


def evaluated_at(run: dict, step: int) -> bool:
    return any(c["step"] == step for c in run["curves"])


def accuracy_table(runs: list[dict], tasks: list[str], models: list[str],
                   step: Optional[int] = None) -> str:
    """Markdown: per model and task the mean (range) accuracy over seeds at `step` (None: each
    run's last evaluation; else over the runs evaluated at that step), and the mean gap to full
    attention on the same seeds, in points."""
    import numpy as np

    rows = {(r["model"], r["seed"]): at_step(r, step) for r in runs
            if step is None or evaluated_at(r, step)}
    lines = ["| model | seeds | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for m in models:
        seeds = sorted(seed for model, seed in rows if model == m)
        if not seeds:
            continue
        cells = []
        for t in tasks:
            cell = mean_range([rows[m, seed][f"acc_{t}"] for seed in seeds])
            gaps = [rows[m, seed][f"acc_{t}"] - rows["full", seed][f"acc_{t}"] for seed in seeds
                    if ("full", seed) in rows]
            if m != "full" and gaps:
                cell += f", {100 * np.mean(gaps):+.1f} pt"
            cells.append(cell)
        lines.append(f"| {m} | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(out: str, steps: tuple = ()) -> str:
    """results.md, summary.csv and curves.png from the runs in `out`; `steps`: also a table at
    each of these steps over the runs evaluated there. -> the tables."""
    from bench import common

    runs = load_runs(out)
    if not runs:
        raise ValueError(f"--out ({out!r}) holds no finished run (no */run.json)")
    tasks = [task_name(p) for p in runs[0]["pairs"]]
    models = [m for m in MODELS if any(r["model"] == m for r in runs)]
    summaries = [r["summary"] for r in runs]
    columns = ["model", "seed", "steps", *(f"acc_{t}" for t in tasks), "kl", "ms_per_step",
               "train_s", "compile_s", "finite"]
    columns += sorted({k for s in summaries for k in s} - set(columns))
    common.write_csv(os.path.join(out, "summary.csv"), summaries, columns)
    planned = runs[0]["recall_args"]["steps"]
    T = runs[0]["recall_args"]["T"]
    text = [f"Accuracy at T {T} after each run's last step, mean (range) over seeds; after a "
            "model's mean, its mean gap to full attention on the same seeds, in points.", "",
            accuracy_table(runs, tasks, models)]
    common_step = min(r["summary"]["steps"] for r in runs)
    if common_step < max(r["summary"]["steps"] for r in runs):
        # Runs stopped by --budget_s at different steps: compare them at a step all reached.
        shared = set.intersection(*({c["step"] for c in r["curves"]} for r in runs))
        reached = int(max(shared))
        text += ["", f"At step {reached}, the last evaluation every run reached (of {planned} "
                 "planned):", "", accuracy_table(runs, tasks, models, reached)]
    for step in steps:
        n = sum(evaluated_at(r, step) for r in runs)
        if n:
            text += ["", f"At step {step} (of {planned} planned), the {n} of {len(runs)} runs "
                     "evaluated there:", "", accuracy_table(runs, tasks, models, step)]
    text += ["", "| model | seed | steps | T last trained | " + " | ".join(tasks)
             + " | alignment KL | ms / step |", "|---|---|---|---|" + "---|" * (len(tasks) + 2)]
    for r in sorted(runs, key=lambda r: (models.index(r["model"]), r["seed"])):
        s, last = r["summary"], at_step(r)
        text.append(f"| {r['model']} | {r['seed']} | {s['steps']} | {int(last['T'])} | "
                    + " | ".join(f"{s[f'acc_{t}']:.3f}" for t in tasks)
                    + f" | {common._cell(s.get('kl'))} | {s['ms_per_step']:.1f} |")
    text += hit_table(runs, tasks, models)
    text += overlap_table(runs, models)
    body = "\n".join(text)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# Recall benchmark\n\n{body}\n")
    plot(os.path.join(out, "curves.png"), runs, tasks, models)
    return body


def mean_range(values, fmt: str = "{:.3f}") -> str:
    """'mean (min-max)' of `values`, each number in `fmt`."""
    return (f"{fmt.format(sum(values) / len(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")


def layer_rows(model: str, have: list[dict], n_layers: int, columns: list) -> list[str]:
    """Table rows `| model | layer | seeds | cells |`, one per layer, each cell the mean (range)
    over `have` (one dict per seed) of a column: (key with `{i}` for the layer, number format).
    No rows when `have` is empty."""
    rows = []
    for i in range(n_layers if have else 0):
        cells = [mean_range([h[key.format(i=i)] for h in have], fmt) for key, fmt in columns]
        rows.append(f"| {model} | {i} | {len(have)} | " + " | ".join(cells) + " |")
    return rows


def hit_table(runs: list[dict], tasks: list[str], models: list[str]) -> list[str]:
    """Lines of a table of the NSA models' selection hit rate per layer and task at each run's
    last evaluation, mean (range) over seeds, with a random selection's; none without hits."""
    n_layers = runs[0]["recall_args"]["n_layers"]
    rows = []
    for m in models:
        lasts = [at_step(r) for r in runs if r["model"] == m]
        have = [row for row in lasts if f"l0_hit_{tasks[0]}" in row]
        rows += layer_rows(m, have, n_layers, [(f"l{{i}}_hit_{t}", "{:.3f}") for t in tasks])
    if not rows:
        return []
    chance = " | ".join(f"{hit_chance(runs[0], t):.3f}" for t in tasks)
    return ["", "Selection hit rate at each run's last evaluation: the share of (query, KV "
            "group) whose selected blocks hold the asked key's block, mean (range) over seeds; "
            "a random choice of the free blocks for comparison:", "",
            "| model | layer | seeds | " + " | ".join(tasks) + " |",
            "|---|---|---|" + "---|" * len(tasks), *rows, f"| random | - | - | {chance} |"]


def overlap_table(runs: list[dict], models: list[str]) -> list[str]:
    """Lines of a table of the NSA models' selection overlap per layer, mean (range) over
    seeds; none when no run has it."""
    n_layers = runs[0]["recall_args"]["n_layers"]
    rows = []
    for m in models:
        have = [r["summary"] for r in runs
                if r["model"] == m and "l0_sel_shared" in r["summary"]]
        rows += layer_rows(m, have, n_layers, [("l{i}_sel_shared", "{:.3f}"),
                                               ("l{i}_sel_jaccard", "{:.3f}"),
                                               ("l{i}_sel_tile_union", "{:.1f}")])
    if not rows:
        return []
    return ["", "Selection overlap of the trained NSA models on the evaluation's longest task, "
            "past the first n_sel blocks (`bench/workloads.py`): shared = mean share of a "
            "query's blocks the next query selects too; tile union = distinct blocks per 64 "
            "consecutive queries. Mean (range) over seeds:", "",
            "| model | layer | seeds | shared | jaccard | tile union |",
            "|---|---|---|---|---|---|", *rows]


def plot(path: str, runs: list[dict], tasks: list[str], models: list[str]) -> None:
    """Accuracy per task, the alignment KL and each layer's selection hit rate on the first
    task against steps; a line per run, a colour per model."""
    import matplotlib

    from bench import common

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers = runs[0]["recall_args"]["n_layers"]
    panels = [(f"acc_{t}", f"{t}: accuracy") for t in tasks]
    panels += [("kl", "alignment KL (nsa_aligned)")]
    panels += [(f"l{i}_hit_{tasks[0]}", f"{tasks[0]}: layer {i}'s selection hit rate")
               for i in range(n_layers)]
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(4.4 * cols,
                             3.4 * math.ceil(len(panels) / cols)), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(MODELS)}
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    chance = hit_chance(runs[0], tasks[0])
    for ax, (key, title) in zip(axes.flat, panels):
        if "_hit_" in key:
            ax.axhline(chance, color="grey", ls="--", lw=1, label="chance")
            title += f" (chance {chance:.2f})"
        for m in models:
            first = True
            for r in (r for r in runs if r["model"] == m):
                points = [(c["step"], c[key]) for c in r["curves"] if c.get(key) is not None]
                if (key == "kl" and r["recipe"] != "kl") or not points:
                    continue
                ax.plot(*zip(*points), color=colors[m], alpha=0.7, lw=1,
                        label=m if first else None)
                first = False
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    common.save_panels(fig, axes.flat[:len(panels)], path)


def hit_chance(run: dict, task: str) -> float:
    """The hit rate of a random choice of the free selected blocks at the evaluation length."""
    from examples import train_recall
    from nsa_jax import NSAConfig

    pairs = {task_name(p): p for p in run["pairs"]}[task]
    cfg = NSAConfig(**run["nsa"])
    return train_recall.selection_chance(train_recall.Task(task, pairs, pairs, max(run["pairs"])),
                                         run["recall_args"]["T"], cfg)


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    if args.run:
        model, _, seed = args.run.partition(":")
        train_one(model, int(seed), args, rest, args.out)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.step_lengths:
        step_times(args, rest, [b for b in args.backends.split(";") if b],
                   list(args.step_lengths))
        return 0
    failures = [] if args.report_only else launch(args, rest)
    print(report(args.out, args.report_steps), flush=True)
    for line in failures:
        print("FAILED", line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
