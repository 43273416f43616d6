"""Train NSA on recall with selection alignment: dense warm-up, then sparse, the KL kept on.

    PYTHONPATH=. python examples/train_aligned.py --preset cpu --steps 400            # CPU
    PYTHONPATH=. python examples/train_aligned.py --tasks mqar --steps 1500 \\
        --dense_steps 500 --mqar_pairs 4                                             # GPU

The recipe (docs/API.md, "Selection alignment"), on the model, data and evaluation of
`examples/train_recall.py` (any of its flags passes through: sizes, `--T`, `--curriculum`, ...):
1. Dense warm-up, the first `--dense_steps` steps: every NSA layer runs with
   `nsa_jax.dense_warmup_config` (every eligible block selected, so the selected branch is full
   causal attention), and the loss is the task's plus `--kl_weight` times the mean over layers
   of `nsa_jax.selection_alignment_loss` (gradient to the compressed keys only).
2. Sparse: the layers run with their own `n_sel`; the alignment loss stays on, its target
   `--kl_mode` ("dense": the full causal attention; "sparse": the selected blocks only).
Prints the task loss, the alignment KL, the eval accuracy and the selection hit rate of each
layer (the queried key's block among the selected ones); `--out` also writes curves.csv.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa_jax
from examples import train_recall


def alignment_kl(params, layers, mc, alignment):
    """The mean over the NSA layers of `nsa_jax.selection_alignment_loss`, from the layer inputs
    and aux of `train_recall.forward(..., collect=True)` (sparse mode: each layer's own
    selection)."""
    sparse = alignment.mode == "sparse"
    return jnp.mean(jnp.stack([
        nsa_jax.selection_alignment_loss(block["attn"], a, mc.nsa, alignment=alignment,
                                         backend=mc.backend,
                                         block_idx=aux["block_idx"] if sparse else None)
        for block, (a, aux) in zip(params["blocks"], layers)]))


def aligned_loss(params, tokens, answers, kl_weight, *, mc, task, alignment):
    """Task loss + kl_weight x the mean alignment KL of the NSA layers.
    -> (loss, (task loss, KL, accuracy))."""
    h, layers = train_recall.forward(params, tokens, mc, collect=True)
    logits = train_recall.logits_at(params, h[:, tokens.shape[1] - task.tail::2])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, answers[..., None], axis=-1).mean()
    kl = alignment_kl(params, layers, mc, alignment)
    accuracy = (jnp.argmax(logits, -1) == answers).mean()
    return nll + kl_weight * kl, (nll, kl, accuracy)


@functools.partial(jax.jit, static_argnames=("mc", "task", "alignment"))
def train_step(params, opt_state, tokens, answers, lr, kl_weight, *, mc, task, alignment):
    grad_fn = jax.value_and_grad(aligned_loss, has_aux=True)
    (_, stats), grads = grad_fn(params, tokens, answers, kl_weight, mc=mc, task=task,
                                alignment=alignment)
    updates, opt_state = train_recall.OPTIMIZER.update(grads, opt_state, params)
    params = jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)
    return params, opt_state, stats


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="total steps (preset's)")
    parser.add_argument("--dense_steps", type=int, default=None,
                        help="dense warm-up steps (default: a third of --steps)")
    parser.add_argument("--kl_weight", type=float, default=1.0)
    parser.add_argument("--kl_mode", choices=nsa_jax.ALIGNMENT_MODES, default="dense",
                        help="the sparse stage's target (the warm-up's is always dense)")
    parser.add_argument("--train_queries", action="store_true",
                        help="the KL's gradient also reaches wq")
    parser.add_argument("--tasks", choices=("needle", "mqar"), default="needle",
                        help="the task (one)")
    parser.add_argument("--out", default=None, help="directory for curves.csv (optional)")
    args, rest = parser.parse_known_args(argv)
    base = ["--out", args.out or ".", "--models", "nsa", "--tasks", args.tasks]
    base += ["--steps", str(args.steps)] if args.steps is not None else []
    recall = train_recall.parse_args(base + rest)  # sizes, curriculum, lr, eval settings
    if args.dense_steps is None:
        args.dense_steps = recall.steps // 3
    if not 0 <= args.dense_steps <= recall.steps:
        parser.error(f"--dense_steps ({args.dense_steps}) must lie in [0, --steps]")
    return args, recall


def main(argv=None) -> list[dict]:
    args, recall = parse_args(argv)
    (run,), vocab = train_recall.build_runs(recall)
    task, mc = run.task, run.mc
    variant = dataclasses.replace(run.variant, dense_init=recall.init == "paired")
    params = train_recall.init_model(jax.random.PRNGKey(recall.seed), mc, variant)
    opt_state = train_recall.OPTIMIZER.init(params)
    rng = np.random.default_rng(recall.seed)
    evaluation = train_recall.make_batch(np.random.default_rng(recall.seed + 1), task, vocab,
                                         recall.eval_batch, recall.T, mc.nsa, recall.shift)
    eval_arrays = [jnp.asarray(evaluation[k]) for k in ("tokens", "answers", "key_pos")]
    stages = train_recall.parse_curriculum(recall.curriculum, recall.steps)
    rows = []
    for step in range(recall.steps):
        T = train_recall.length_at(step, stages, recall.T)
        dense = step < args.dense_steps
        # The warm-up's selection takes every block; its target is then the dense one anyway.
        stage_mc = (dataclasses.replace(mc, nsa=nsa_jax.dense_warmup_config(mc.nsa, T))
                    if dense else mc)
        alignment = nsa_jax.AlignmentOptions(mode="dense" if dense else args.kl_mode,
                                             train_queries=args.train_queries)
        batch = train_recall.make_batch(rng, task, vocab, recall.batch, T, mc.nsa, recall.shift)
        lr = train_recall.learning_rate(step, recall.lr, recall.warmup, recall.steps)
        params, opt_state, (nll, kl, acc) = train_step(
            params, opt_state, batch["tokens"], batch["answers"], jnp.float32(lr),
            jnp.float32(args.kl_weight), mc=stage_mc, task=task, alignment=alignment)
        if (step + 1) % recall.eval_every == 0 or step + 1 == recall.steps:
            stats = train_recall.in_chunks(
                functools.partial(train_recall.evaluate, params, mc=mc, task=task),
                eval_arrays, recall.eval_chunk)
            hits = {k: v for k, v in stats.items() if k.endswith("_hit")}
            rows.append(dict(step=step + 1, T=T, stage="dense" if dense else "sparse",
                             train_loss=float(nll), kl=float(kl), train_acc=float(acc),
                             eval_acc=stats["acc"], **hits))
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in rows[-1].items()), flush=True)
    if args.out:
        from bench import common

        os.makedirs(args.out, exist_ok=True)
        common.write_csv(os.path.join(args.out, "curves.csv"), rows, list(rows[-1]))
    return rows


if __name__ == "__main__":
    main()
