"""Train a small decoder LM with NSA on long-range recall, against full and window attention.

    PYTHONPATH=. python examples/train_recall.py --out /tmp/recall            # GPU, ~5 minutes
    PYTHONPATH=. python examples/train_recall.py --preset cpu --out /tmp/r    # CPU, T 256

Tasks (synthetic, every queried key lies beyond the sliding window and beyond NSA's forced
blocks, so neither the window branch nor the forced selection can see it):
- needle: one key/value pair hidden in random filler; the key is repeated at the end, the model
  must emit the value.
- mqar: multi-query associative recall; `--mqar_pairs` key/value pairs in the filler, all queried
  at the end in random order as `k v k v ...` (loss on each value).

Models: the same pre-norm decoder (embeddings, [RMSNorm, attention, RMSNorm, GELU MLP] x
n_layers, RMSNorm, head) with `attention` = "nsa" (`nsa_jax.nsa_attention`), "full" (causal
`jax.nn.dot_product_attention`) or "window" (the same with NSA's window). NSA runs as several
`--variants` (gate bias, compression init / learning rate, n_sel, mean compression) that test
why a small NSA model may fail to learn recall: the selection ranks blocks by compressed-attention
scores, which get gradient only through the compressed branch (selection is not differentiable),
so the selected blocks start out near random; and the gates may drown the selected branch.

Instrumentation (at each evaluation, on the query positions of a fixed eval set, per NSA layer):
mean gate per branch, selection hit rate (the query's selected blocks contain the queried key's
block), and the compressed attention's probability mass on the blocks covering the key; for the
full model, the probe of `pooled_ranking` (its attention mass on the key's block, and whether
NSA's selection over mean-pooled copies of its own keys would pick that block). At the end,
greedy generation through the decode cache (`prefill` + `decode_step`) is checked against the
model's own teacher-forced predictions.

Writes into `--out`: curves.csv (one row per evaluation), summary.csv, results.md (the table),
stats.json (configuration, environment, per-run results) and curves.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ""):
    # Run as a file (`python examples/train_recall.py`): the repository's own packages (bench)
    # must import without PYTHONPATH=. too, or the outputs fail after the training.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa_jax
from nsa_jax import NSAConfig

BRANCHES = ("cmp", "sel", "win")
ATTENTIONS = ("full", "window", "nsa")


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Vocab:
    """Token ranges: filler [0, n_filler), keys, then values."""

    n_filler: int = 64
    n_keys: int = 64
    n_values: int = 64

    @property
    def size(self) -> int:
        return self.n_filler + self.n_keys + self.n_values

    @property
    def first_key(self) -> int:
        return self.n_filler

    @property
    def first_value(self) -> int:
        return self.n_filler + self.n_keys


@dataclasses.dataclass(frozen=True)
class Task:
    """`n_pairs` key / value pairs in the filler, `n_queries` of them asked at the end.
    `slots`: query slots reserved at the end (0: `n_queries`); the asked queries take the last
    ones and the slots before them hold filler, so that sequences with different numbers of
    pairs share one format (`examples/recall_benchmark.py` mixes 1, 4 and 16)."""

    name: str
    n_pairs: int
    n_queries: int
    slots: int = 0

    @property
    def tail(self) -> int:
        """Tokens of the asked query segment `k v k v ...` at the end of the sequence."""
        return 2 * self.n_queries

    @property
    def reserved(self) -> int:
        """Tokens at the end kept free of pairs: the query slots."""
        return 2 * max(self.n_queries, self.slots)


def make_tasks(mqar_pairs: int) -> dict[str, Task]:
    return {"needle": Task("needle", 1, 1), "mqar": Task("mqar", mqar_pairs, mqar_pairs)}


def pair_region(task: Task, T: int, cfg: NSAConfig) -> tuple[int, int]:
    """Positions `[lo, hi)` where key/value pairs may go.

    lo skips NSA's forced initial blocks; hi keeps every pair more than `window` tokens before
    the first query and outside the query's forced local blocks, so that only a correct
    selection (or the compressed branch) can reach it.
    """
    first_query = T - task.reserved
    lo = cfg.n_init * cfg.sel_block
    hi = min(first_query - cfg.window - 1,
             (first_query // cfg.sel_block - cfg.n_local + 1) * cfg.sel_block)
    if (hi - lo) // 2 < task.n_pairs:
        raise ValueError(f"T = {T} leaves no room for {task.n_pairs} pairs beyond the window "
                         f"({cfg.window}) and the forced blocks; raise T")
    return lo, hi


SHIFTS = ("none", "half", "edge")


def pair_slots(task: Task, T: int, cfg: NSAConfig, shift: str = "none") -> np.ndarray:
    """Positions a key may take (its value follows it) for `shift`, the key's place in its
    selection block (`l_sel` tokens):
    - "none": any even offset of the pair region (lo is a multiple of l_sel, so a key and its
      value share a selection block); a key at offset 0 shares compressed blocks (stride d)
      with the previous selection block;
    - "half": offset l_sel / 2, one pair per selection block: every compressed block that
      covers the key lies inside the key's selection block (l <= l_sel / 2);
    - "edge": offset l_sel - 2 (the value ends the block): the compressed blocks covering the
      key reach into the next selection block, which their score also feeds.
    """
    lo, hi = pair_region(task, T, cfg)
    if shift == "none":
        return np.arange(lo, hi - 1, 2)
    if shift not in SHIFTS:
        raise ValueError(f"shift ({shift!r}) must be one of {SHIFTS}")
    offset = cfg.sel_block // 2 if shift == "half" else cfg.sel_block - 2
    starts = np.arange(lo, hi, cfg.sel_block) + offset
    slots = starts[starts + 1 < hi]
    if len(slots) < task.n_pairs:
        raise ValueError(f"shift {shift!r} at T = {T} leaves {len(slots)} selection blocks for "
                         f"{task.n_pairs} pairs; raise T")
    return slots


def make_batch(rng: np.random.Generator, task: Task, vocab: Vocab, B: int, T: int,
               cfg: NSAConfig, shift: str = "none") -> dict[str, np.ndarray]:
    """-> tokens int32 `[B, T]`, answers int32 `[B, n_queries]` (the value each query must
    produce), key_pos int32 `[B, n_queries]` (where the queried key sits in the context).
    `shift`: where keys sit in their selection blocks (`pair_slots`)."""
    if task.n_pairs > vocab.n_keys:
        raise ValueError(f"{task.n_pairs} pairs need as many distinct keys (n_keys = "
                         f"{vocab.n_keys})")
    candidates = pair_slots(task, T, cfg, shift)
    tokens = rng.integers(0, vocab.n_filler, (B, T))
    rows = np.arange(B)[:, None]
    slots = np.argsort(rng.random((B, len(candidates))), axis=1)[:, :task.n_pairs]
    key_pos = candidates[slots]                                               # [B, P]
    keys = vocab.first_key + np.argsort(rng.random((B, vocab.n_keys)), axis=1)[:, :task.n_pairs]
    values = vocab.first_value + rng.integers(0, vocab.n_values, (B, task.n_pairs))
    tokens[rows, key_pos] = keys
    tokens[rows, key_pos + 1] = values
    asked = np.argsort(rng.random((B, task.n_pairs)), axis=1)[:, :task.n_queries]
    first_query = T - task.tail
    tokens[:, first_query::2] = keys[rows, asked]
    tokens[:, first_query + 1::2] = values[rows, asked]
    return dict(tokens=tokens.astype(np.int32), answers=values[rows, asked].astype(np.int32),
                key_pos=key_pos[rows, asked].astype(np.int32))


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (a `jax.jit` static argument). `nsa` also gives the head sizes, RoPE and the
    window of the "full" and "window" models."""

    attention: str
    nsa: NSAConfig
    vocab_size: int
    n_layers: int = 2
    mlp_ratio: int = 4
    backend: tuple = ("xla",)
    # The "full" / "window" models' kernel: None (`jax.nn.dot_product_attention`'s default),
    # "xla" or "cudnn" (its `implementation`), or "fa3" (`flash_attn3_jax.flash_mha`, bf16 /
    # fp16 on Hopper). cuDNN and FA-3 take d_v = d_k only.
    dense_kernel: Optional[str] = None
    # A token shift before each attention (as RWKV's): per channel c, the layer input becomes
    # a_t + mix_c * (a_{t-1} - a_t), mix learned and initialised to a ramp over [0, 1], so a
    # position's keys can hold the token before it and recall takes one attention hop instead
    # of an induction circuit of two layers (examples/RECALL_NOTES.md). No decode path.
    token_shift: bool = False


@dataclasses.dataclass(frozen=True)
class Variant:
    """NSA settings under test. Defaults are the library's (`bg` 0, so every gate starts at 0.5;
    compression MLP `normal(0, 1/sqrt(fan_in))`)."""

    name: str = "default"
    gate_bias: tuple = (0.0, 0.0, 0.0)  # bg of every head, per branch (cmp, sel, win)
    cmp_init_scale: float = 1.0  # multiplies cmp_k / cmp_v w1 and w2 at init
    cmp_lr_mult: float = 1.0  # learning-rate multiplier of wk/wv["cmp"] and cmp_k / cmp_v
    n_sel_mult: int = 1  # n_sel = n_sel_mult x the base n_sel
    compress: Optional[str] = None  # "mean": parameter-free compression (as fla's NSA)
    shared_kv: bool = False  # one K/V projection for the three branches (NSAConfig.shared_kv)
    fixed_gates: bool = False  # wg starts at 0 and wg, bg are not trained: gates = sigmoid(bg)
    # Start from the "full" model's initial weights (same key): embeddings, norms, MLPs, head,
    # and wq / wk["sel"] / wv["sel"] / wo of every layer (`nsa_from_dense`).
    dense_init: bool = False


VARIANTS = {
    "default": Variant(),
    # Gates drown the selected branch? Start with sel at sigmoid(2) = 0.88, the others at 0.5.
    "sel_gate": Variant("sel_gate", gate_bias=(0.0, 2.0, 0.0)),
    # The ranking learns too slowly? Compression path at 10x the learning rate.
    "cmp_lr10": Variant("cmp_lr10", cmp_lr_mult=10.0),
    # Random compression MLP scrambles the scores? Mean pooling keeps a block's key direction.
    "mean_cmp": Variant("mean_cmp", compress="mean"),
    # Near-random selection early on: more blocks make a hit likelier (2x the base n_sel).
    "nsel_x2": Variant("nsel_x2", n_sel_mult=2),
    # A compression MLP near zero at init: compressed keys start from the biases and pos only.
    "small_cmp_init": Variant("small_cmp_init", cmp_init_scale=0.1),
    # The two fixes that need no new learning rate, together.
    "mean_sel_gate": Variant("mean_sel_gate", compress="mean", gate_bias=(0.0, 2.0, 0.0)),
    # The compressed keys learn from the selected and window branches' gradients too: one K/V
    # projection serves the three branches, so the key direction the selected branch needs is
    # the one the compression (and so the ranking) sees.
    "shared_kv": Variant("shared_kv", shared_kv=True),
    # Shared K/V and mean pooling: a compressed key is the mean of the block's own keys.
    "mean_shared": Variant("mean_shared", compress="mean", shared_kv=True),
    # A diagnostic, not a fix: the selected branch alone (gates start at 0.98 / 0.02), so with
    # n_sel covering every block NSA is full attention with its own projections and gates.
    "sel_only": Variant("sel_only", gate_bias=(-4.0, 4.0, -4.0)),
    # The ranking learns only through the compressed branch's scores, and with sel_only's
    # compressed gate near 0 they get almost no gradient (a sel_only run measured layer 1's
    # compressed-key gradient 2,500x below the selected keys'; the hit rate stayed at chance). Start the compressed
    # and selected gates at 0.98 and the window at 0.02; `cmp_sel_shared` also shares one K/V
    # projection, so the selected branch's gradient reaches the compressed keys too.
    "cmp_sel": Variant("cmp_sel", gate_bias=(4.0, 4.0, -4.0)),
    "cmp_sel_shared": Variant("cmp_sel_shared", gate_bias=(4.0, 4.0, -4.0), shared_kv=True),
    # sel_only's gates with mean pooling over one K/V projection shared by the branches: a
    # compressed key is the mean of its block's selected-branch keys, so the ranking scores
    # `q . mean(k)` sharpen as the selected branch learns `q . k`, with no gradient through the
    # compressed branch (whose gate sel_only keeps near 0).
    "sel_mean_shared": Variant("sel_mean_shared", gate_bias=(-4.0, 4.0, -4.0), compress="mean",
                               shared_kv=True),
    # mean_shared with every gate held at 0.5 (wg 0, bg 0 and not trained): the compressed
    # branch cannot close, so its gradient keeps reaching the scores the selection ranks by
    # (at T 2048, layer 1's compressed gate closed in 4 of 6 `sel_mean_shared` runs;
    # RECALL_NOTES section 15).
    "mean_shared_fixed": Variant("mean_shared_fixed", compress="mean", shared_kv=True,
                                 fixed_gates=True),
    # Diagnostics: gates fixed at (0, 1, 0) (sigmoid(+-30)); with n_sel covering every block the
    # layer is then exactly the full-attention layer, so `sel_fixed_dense` (the full model's
    # initial weights) must train as `full` does, and `sel_fixed` (NSA's own draw) tells
    # whether the initial draw decides when the model leaves the plateau.
    "sel_fixed": Variant("sel_fixed", gate_bias=(-30.0, 30.0, -30.0), fixed_gates=True),
    "sel_fixed_dense": Variant("sel_fixed_dense", gate_bias=(-30.0, 30.0, -30.0),
                               fixed_gates=True, dense_init=True),
    "sel_only_dense": Variant("sel_only_dense", gate_bias=(-4.0, 4.0, -4.0), dense_init=True),
    # The library's defaults from the full model's initial weights: NSA and full attention
    # compared on the same draw.
    "dense": Variant("dense", dense_init=True),
}


def variant_cfg(cfg: NSAConfig, variant: Variant) -> NSAConfig:
    changes: dict[str, Any] = {"n_sel": cfg.n_sel * variant.n_sel_mult}
    if variant.compress is not None:
        changes["compress"] = variant.compress
    if variant.shared_kv:
        changes["shared_kv"] = True
    return cfg.replace(**changes)


def _normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def init_model(key: jax.Array, mc: ModelConfig, variant: Variant = Variant()) -> dict:
    cfg, D = mc.nsa, mc.nsa.d_model
    H, G, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    keys = iter(jax.random.split(key, 4 + 8 * mc.n_layers))
    blocks = []
    for _ in range(mc.n_layers):
        if mc.attention == "nsa":
            attn = nsa_jax.init_params(next(keys), cfg)
            attn["bg"] = jnp.tile(jnp.asarray(variant.gate_bias, jnp.float32), H)  # [H*3]
            if variant.fixed_gates:
                attn["wg"] = jnp.zeros_like(attn["wg"])
            if cfg.compress == "mlp":
                for name in ("cmp_k", "cmp_v"):
                    for w in ("w1", "w2"):
                        attn[name][w] = attn[name][w] * variant.cmp_init_scale
        else:
            attn = {"wq": _normal(next(keys), (D, H * dk), D ** -0.5),
                    "wk": _normal(next(keys), (D, G * dk), D ** -0.5),
                    "wv": _normal(next(keys), (D, G * dv), D ** -0.5),
                    "wo": _normal(next(keys), (H * dv, D), (H * dv) ** -0.5)}
        blocks.append({
            "norm1": jnp.ones((D,)), "attn": attn, "norm2": jnp.ones((D,)),
            "mlp": {"w1": _normal(next(keys), (D, mc.mlp_ratio * D), D ** -0.5),
                    "w2": _normal(next(keys), (mc.mlp_ratio * D, D), (mc.mlp_ratio * D) ** -0.5)},
        })
        if mc.token_shift:
            blocks[-1]["shift_mix"] = jnp.linspace(0.0, 1.0, D)
    params = {"embed": _normal(next(keys), (mc.vocab_size, D), 1.0), "blocks": blocks,
              "norm_f": jnp.ones((D,)), "head": _normal(next(keys), (D, mc.vocab_size), D ** -0.5)}
    if mc.attention == "nsa" and variant.dense_init:
        params = nsa_from_dense(init_model(key, dataclasses.replace(mc, attention="full")), params)
    return params


def nsa_from_dense(dense: dict, nsa: dict) -> dict:
    """The NSA model `nsa` with every parameter it shares with the full-attention model `dense`
    taken from `dense`: embeddings, norms, MLPs, head, and per layer wq, wo and the selected
    branch's K/V projections (`wk["sel"]`, `wv["sel"]`; `shared` with shared_kv). With gates
    (0, 1, 0) and n_sel covering every block the two models compute the same function."""
    out = {k: dense[k] for k in ("embed", "norm_f", "head")}
    out["blocks"] = []
    for d, n in zip(dense["blocks"], nsa["blocks"]):
        attn = dict(n["attn"], wq=d["attn"]["wq"], wo=d["attn"]["wo"])
        sel = "shared" if "shared" in attn["wk"] else "sel"
        attn["wk"] = dict(attn["wk"], **{sel: d["attn"]["wk"]})
        attn["wv"] = dict(attn["wv"], **{sel: d["attn"]["wv"]})
        out["blocks"].append(dict(d, attn=attn))
    return out


def lr_multipliers(params: dict, variant: Variant) -> dict:
    """A pytree like params: `variant.cmp_lr_mult` on the compression path, 0 on the gates
    (wg, bg) with `variant.fixed_gates`, 1 elsewhere."""
    def mult(path, leaf):
        names = [getattr(p, "key", None) for p in path]
        cmp_path = ("cmp_k" in names or "cmp_v" in names
                    or (names[-1] == "cmp" and ("wk" in names or "wv" in names)))
        if variant.fixed_gates and names[-1] in ("wg", "bg"):
            return jnp.zeros((), jnp.float32)
        return jnp.full((), variant.cmp_lr_mult if cmp_path else 1.0, jnp.float32)
    return jax.tree_util.tree_map_with_path(mult, params)


def rms_norm(x, weight, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def roped_heads(x: jax.Array, w: jax.Array, n_heads: int, positions: jax.Array,
                cfg: NSAConfig) -> jax.Array:
    """x `[B, L, D]` @ w -> `[B, L, n_heads, d_k]`, RoPE'd at `positions` `[L]` as in NSA (none
    when `cfg.rope_theta` is None): the query / key heads of every model and probe here."""
    heads = (x @ w).reshape(*x.shape[:2], n_heads, cfg.d_k)
    if cfg.rope_theta is None:
        return heads
    return nsa_jax.apply_rope(heads, positions, cfg.rope_theta)


def dense_attention(attn: dict, x: jax.Array, mc: ModelConfig) -> jax.Array:
    """The "full" / "window" baselines: x `[B, T, D]` -> `[B, T, D]`, RoPE as in NSA."""
    cfg = mc.nsa
    B, T, _ = x.shape
    positions = jnp.arange(T, dtype=jnp.int32)
    q = roped_heads(x, attn["wq"], cfg.n_heads, positions, cfg)
    k = roped_heads(x, attn["wk"], cfg.n_kv_heads, positions, cfg)
    v = (x @ attn["wv"]).reshape(B, T, cfg.n_kv_heads, cfg.d_v)
    # (w - 1, 0): query t sees keys t-w+1 .. t, NSA's window branch exactly.
    window = (cfg.window - 1, 0) if mc.attention == "window" else None
    if mc.dense_kernel == "fa3":
        from flash_attn3_jax import flash_mha

        o = flash_mha(q, k, v, is_causal=True, window_size=window or (-1, -1))
    else:
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                         implementation=mc.dense_kernel)
    return o.reshape(B, T, cfg.n_heads * cfg.d_v) @ attn["wo"]


def attention_input(blk: dict, h: jax.Array) -> jax.Array:
    """The normed layer input `[B, T, D]` the attention reads, token-shifted where the model
    has a shift (`ModelConfig.token_shift`)."""
    a = rms_norm(h, blk["norm1"])
    if "shift_mix" not in blk:
        return a
    prev = jnp.pad(a[:, :-1], ((0, 0), (1, 0), (0, 0)))
    return a + blk["shift_mix"].astype(a.dtype) * (prev - a)


def mlp(p: dict, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _block_mlp(blk: dict, h: jax.Array) -> jax.Array:
    """The residual MLP half of a block."""
    return h + mlp(blk["mlp"], rms_norm(h, blk["norm2"]))


def forward(params: dict, tokens: jax.Array, mc: ModelConfig, collect: bool = False,
            layer_backends: Optional[list] = None):
    """tokens int `[B, T]` -> final hidden states `[B, T, D]`, and with `collect` a list per
    layer of (layer input after the norm, the layer's aux dict; None for "full" / "window").
    layer_backends: an NSA dispatch backend per layer (None: `mc.backend` everywhere)."""
    h = params["embed"][tokens]
    layers = []
    for i, blk in enumerate(params["blocks"]):
        a = attention_input(blk, h)
        if mc.attention == "nsa":
            backend = mc.backend if layer_backends is None else layer_backends[i]
            y, aux = nsa_jax.nsa_attention(blk["attn"], a, mc.nsa, backend=backend,
                                           return_aux=True)
            layers.append((a, aux))
        else:
            y = dense_attention(blk["attn"], a, mc)
            layers.append((a, None))
        h = _block_mlp(blk, h + y)
    h = rms_norm(h, params["norm_f"])
    return (h, layers) if collect else h


def logits_at(params: dict, h: jax.Array) -> jax.Array:
    return h @ params["head"]


def query_logits(params, tokens, mc: ModelConfig, task: Task,
                 layer_backends: Optional[list] = None) -> jax.Array:
    """Logits `[B, n_queries, V]` at the query keys of the tail (they predict the values)."""
    h = forward(params, tokens, mc, layer_backends=layer_backends)
    return logits_at(params, h[:, tokens.shape[1] - task.tail::2])


def loss_and_accuracy(params, tokens, answers, mc: ModelConfig, task: Task):
    logits = query_logits(params, tokens, mc, task).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), answers[..., None], axis=-1)
    return nll.mean(), (jnp.argmax(logits, -1) == answers).mean()


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
# Adam without its learning rate: the rate (schedule value x per-leaf multiplier) is applied in
# the step as a traced input, so runs that differ only in rates share one compiled step.
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.98))


def learning_rate(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def grad_norms(grads: dict, mc: ModelConfig) -> dict:
    """Per NSA layer i, the gradient norms that say whether the ranking can learn:
    `l{i}_gk_{name}` (the key projection of each K/V set: cmp / sel / win, or shared),
    `l{i}_g_cmp_mlp` (cmp_k's MLP and positions), `l{i}_g_gate` (wg, bg), `l{i}_g_wq`."""
    out = {}
    if mc.attention != "nsa":
        return out
    norm = optax.tree.norm
    for i, blk in enumerate(grads["blocks"]):
        attn = blk["attn"]
        for name, g in attn["wk"].items():
            out[f"l{i}_gk_{name}"] = norm(g)
        if "cmp_k" in attn:
            out[f"l{i}_g_cmp_mlp"] = norm(attn["cmp_k"])
        out[f"l{i}_g_gate"] = norm((attn["wg"], attn["bg"]))
        out[f"l{i}_g_wq"] = norm(attn["wq"])
    return out


@functools.partial(jax.jit, static_argnames=("mc", "task"))
def train_step(params, opt_state, tokens, answers, lr, mults, *, mc: ModelConfig, task: Task):
    (loss, acc), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(
        params, tokens, answers, mc, task)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    params = jax.tree_util.tree_map(lambda p, u, m: p - lr * m * u, params, updates, mults)
    return params, opt_state, loss, grad_norms(grads, mc)


def parse_curriculum(text: str, steps: int) -> list[tuple[int, int]]:
    """`"512:400,1024:800"` -> [(512, 400), (1024, 800)]: sequences of 512 tokens for steps
    [0, 400), of 1024 for [400, 800), then the run's T to the end. Each number after the colon
    is the step at which that stage ends (cumulative), so `--steps` stays the total."""
    stages, end = [], 0
    for item in filter(None, (text or "").split(",")):
        T, _, until = item.partition(":")
        if not until:
            raise ValueError(f"curriculum stage {item!r} must be T:until_step")
        stage = (int(T), int(until))
        if stage[1] <= end or stage[1] > steps:
            raise ValueError(f"curriculum ({text!r}): stage ends must rise within --steps "
                             f"({steps})")
        stages.append(stage)
        end = stage[1]
    return stages


def length_at(step: int, stages: list[tuple[int, int]], T: int) -> int:
    """The training sequence length at `step` under the curriculum `stages`."""
    return next((t for t, until in stages if step < until), T)


# ---------------------------------------------------------------------------------------------
# Instrumentation
# ---------------------------------------------------------------------------------------------
def compressed_mass(attn: dict, a: jax.Array, q_pos: np.ndarray, key_pos: jax.Array,
                    cfg: NSAConfig) -> tuple[jax.Array, jax.Array]:
    """Probability mass the compressed branch puts on the blocks covering each queried key.

    a `[B, T, D]` (the layer's normed input), q_pos `[Q]` (static), key_pos `[B, Q]`.
    -> (mean mass, mean mass a uniform distribution over the admissible blocks would give).
    The projections repeat the layer's (DESIGN.md parameter layout, RoPE'd keys compressed
    by the public `compress_kv`) for the Q query rows only: the layer returns no p_cmp.
    """
    B, T, _ = a.shape
    H, G, dk = cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    kv = "shared" if cfg.shared_kv else "cmp"
    k = roped_heads(a, attn["wk"][kv], G, jnp.arange(T, dtype=jnp.int32), cfg)
    q = roped_heads(a[:, q_pos], attn["wq"], H, jnp.asarray(q_pos, jnp.int32), cfg)
    k_cmp = nsa_jax.compress_kv(k, attn["cmp_k"] if cfg.compress == "mlp" else None, cfg)
    scores = jnp.einsum("bqghd,bcgd->bqghc", q.reshape(B, len(q_pos), G, H // G, dk),
                        k_cmp) * cfg.scale
    start = np.arange(k_cmp.shape[1]) * cfg.cmp_stride
    admissible = jnp.asarray(start[None, :] + cfg.cmp_block - 1 <= q_pos[:, None])  # [Q, C]
    p = jax.nn.softmax(jnp.where(admissible[None, :, None, None], scores, -jnp.inf), axis=-1)
    covers = ((start <= key_pos[..., None]) & (key_pos[..., None] < start + cfg.cmp_block)
              & admissible[None])                                                 # [B, Q, C]
    mass = (p * covers[:, :, None, None, :]).sum(-1).mean()
    uniform = (covers.sum(-1) / admissible.sum(-1)[None]).mean()
    return mass, uniform


# The pooled-ranking probe of the full model (`pooled_ranking`): NSA's selection over mean-pooled
# keys with the model's compression blocks (`pool`) and with blocks of 8, stride 4 (`pool8`).
PROBE_POOLS = (("pool", None), ("pool8", (8, 4)))


def pooled_ranking(attn: dict, a: jax.Array, q_pos: np.ndarray, key_pos: jax.Array,
                   cfg: NSAConfig) -> dict:
    """The full model's layer seen through NSA's selection: would ranking blocks by its own
    learned scores, mean-pooled as `compress="mean"` with shared K/V pools them, find the key?

    a `[B, T, D]` (the layer's normed input), q_pos `[Q]` (static), key_pos `[B, Q]`.
    -> `key_mass`: the attention mass the full model's heads put on the queried key's
    selection block at the query rows (does this layer retrieve?); `{pool}_hit` per
    `PROBE_POOLS`: how often `nsa_jax.select_blocks` over the layer's own q and mean-pooled
    RoPE'd keys picks that block (what the selection of `sel_mean_shared` / `mean_shared`
    would achieve had its selected branch learned exactly these scores).
    """
    B, T, _ = a.shape
    H, G, dk = cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    positions = jnp.arange(T, dtype=jnp.int32)
    q = roped_heads(a, attn["wq"], H, positions, cfg)
    k = roped_heads(a, attn["wk"], G, positions, cfg)
    Q = len(q_pos)
    scores = jnp.einsum("bqghd,btgd->bqght", q[:, q_pos].reshape(B, Q, G, H // G, dk),
                        k) * cfg.scale
    causal = jnp.asarray(np.arange(T)[None, :] <= q_pos[:, None])                   # [Q, T]
    p = jax.nn.softmax(jnp.where(causal[None, :, None, None], scores, -jnp.inf), axis=-1)
    key_block = (key_pos // cfg.sel_block)[:, :, None, None]                         # [B, Q, 1, 1]
    in_block = (positions // cfg.sel_block)[None, None, None, None, :] == key_block[..., None]
    out = {"key_mass": (p * in_block).sum(-1).mean()}
    for name, pool in PROBE_POOLS:
        pooled = cfg.replace(compress="mean", shared_kv=True, **(
            {} if pool is None else {"cmp_block": pool[0], "cmp_stride": pool[1]}))
        k_cmp = nsa_jax.compress_kv(k, None, pooled)
        block_idx = nsa_jax.select_blocks(q, k_cmp, pooled)[:, q_pos]             # [B, Q, G, n]
        out[f"{name}_hit"] = (block_idx == key_block).any(-1).mean()
    return out


@functools.partial(jax.jit, static_argnames=("mc", "task", "probe"))
def evaluate(params, tokens, answers, key_pos, *, mc: ModelConfig, task: Task,
             probe: bool = True) -> dict:
    """Loss and accuracy at the query keys, and per NSA layer i at those positions: `l{i}_gate_c`
    (mean gate of branch c), `l{i}_hit` (fraction of (query, KV group) whose selected blocks
    contain the queried key's block), `l{i}_cmp_mass` and its uniform baseline; per layer of
    the full model, with `probe`, `pooled_ranking`'s probe (`l{i}_key_mass`, `l{i}_pool_hit`,
    ...)."""
    T = tokens.shape[1]
    q_pos = np.arange(T - task.tail, T, 2)
    h, layers = forward(params, tokens, mc, collect=True)
    logits = logits_at(params, h[:, q_pos]).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), answers[..., None], axis=-1)
    out = {"loss": nll.mean(), "acc": (jnp.argmax(logits, -1) == answers).mean()}
    cfg = mc.nsa
    for i, (a, aux) in enumerate(layers):
        if mc.attention == "full" and probe:
            ranking = pooled_ranking(params["blocks"][i]["attn"], a, q_pos, key_pos, cfg)
            out.update({f"l{i}_{k}": v for k, v in ranking.items()})
        if aux is None:
            continue
        gates = aux["gates"][:, q_pos]                                      # [B, Q, H, 3]
        for c, name in enumerate(BRANCHES):
            out[f"l{i}_gate_{name}"] = gates[..., c].mean()
        block_idx = aux["block_idx"][:, q_pos]                              # [B, Q, G, n_sel]
        key_block = (key_pos // cfg.sel_block)[:, :, None, None]
        out[f"l{i}_hit"] = (block_idx == key_block).any(-1).mean()
        out[f"l{i}_cmp_mass"], out[f"l{i}_cmp_uniform"] = compressed_mass(
            params["blocks"][i]["attn"], a, q_pos, key_pos, cfg)
    return out


def in_chunks(fn, arrays, chunk: int, **kwargs) -> dict:
    """`fn(*arrays, **kwargs)`, a dict of means over the batch rows, run `chunk` rows at a time
    and averaged by rows, so that the whole eval batch need not fit at once: full attention at
    T 2048 holds about 0.25 GB of scores a row (an H100's 80 GB ran out at 256 rows).
    Every statistic of `evaluate` and `ablation_accuracy` is a mean over rows, so the result is
    the one-call result up to float rounding."""
    if chunk <= 0:
        raise ValueError(f"--eval_chunk ({chunk}) must be positive")
    rows = arrays[0].shape[0]
    totals: dict = {}
    for lo in range(0, rows, chunk):
        part = [a[lo:lo + chunk] for a in arrays]
        weight = part[0].shape[0] / rows
        for k, v in fn(*part, **kwargs).items():
            totals[k] = totals.get(k, 0.0) + weight * float(v)
    return totals


EXCLUDE_BACKEND = "recall_exclude_key_blocks"


def exclude_key_blocks(key_pos: np.ndarray, cfg: NSAConfig, fallback,
                       positions: Optional[np.ndarray] = None) -> str:
    """Register (again) a dispatch backend whose selection is `fallback`'s with the blocks
    holding each row's queried keys (`key_pos [B, K]`) removed from the selected blocks (their
    slots become -1, no block) of the queries at `positions` (a bool mask `[T]`; None: every
    query), and return its name. The ablation of `ablation_accuracy`: what the selected branch
    of a layer contributes by reading the key's block."""
    blocks = jnp.asarray(np.asarray(key_pos) // cfg.sel_block, jnp.int32)    # [B, K]

    def select(q, k_cmp, cfg, **kwargs):
        idx = nsa_jax.dispatch.call("select_blocks", fallback, q, k_cmp, cfg, **kwargs)
        hit = (idx[..., None] == blocks[:, None, None, None, :]).any(-1)
        if positions is not None:
            hit = hit & jnp.asarray(positions)[None, :, None, None]
        return jnp.where(hit, -1, idx)

    nsa_jax.dispatch.register_backend("select_blocks", EXCLUDE_BACKEND, select)
    return EXCLUDE_BACKEND


# (label, layers, positions): the queried keys' blocks taken out of the selection of those
# layers, at every query, at the answer positions only, or at every other position.
ABLATIONS = (("first", "first", "all"), ("first_at_query", "first", "query"),
             ("first_elsewhere", "first", "others"), ("last", "last", "all"),
             ("last_at_query", "last", "query"), ("all", "all", "all"))


def ablation_accuracy(params, tokens, answers, key_pos, *, mc: ModelConfig,
                      task: Task) -> dict:
    """Eval accuracy with the queried keys' blocks removed from the selection (`ABLATIONS`:
    of layer 0, of the last layer, of every layer; at the answer positions or elsewhere):
    whether the model retrieves through the selected branch, in which layer, and whether at
    the answer's own position or through other tokens."""
    T = tokens.shape[1]
    at_query = np.zeros(T, bool)
    at_query[T - task.tail::2] = True          # the positions `query_logits` reads
    layer_sets = {"first": [0], "last": [mc.n_layers - 1], "all": list(range(mc.n_layers))}
    out = {}
    for label, layers, where in ABLATIONS:
        exclude_key_blocks(key_pos, mc.nsa, mc.backend,
                           {"all": None, "query": at_query, "others": ~at_query}[where])
        backends = [(EXCLUDE_BACKEND, *mc.backend) if i in layer_sets[layers] else mc.backend
                    for i in range(mc.n_layers)]
        logits = query_logits(params, tokens, mc, task, backends).astype(jnp.float32)
        out[f"acc_excl_{label}"] = float((jnp.argmax(logits, -1) == answers).mean())
    return out


def selection_chance(task: Task, T: int, cfg: NSAConfig) -> float:
    """Hit rate of a uniformly random choice of the free (non-forced) selected blocks."""
    first_query = T - task.tail
    eligible = np.arange(first_query, T, 2) // cfg.sel_block + 1
    free = eligible - cfg.n_init - cfg.n_local
    return float(np.mean(np.minimum(1.0, (cfg.n_sel - cfg.n_init - cfg.n_local) / free)))


# ---------------------------------------------------------------------------------------------
# Greedy generation through the decode cache
# ---------------------------------------------------------------------------------------------
forward_jit = jax.jit(forward, static_argnames=("mc", "collect"))


@functools.partial(jax.jit, static_argnames=("mc",))
def _prefill_model(params, prompt, caches, *, mc: ModelConfig):
    """Every layer's `nsa_jax.prefill` over prompt `[B, P]` -> (last logits `[B, V]`, caches)."""
    h, caches = params["embed"][prompt], list(caches)
    for i, blk in enumerate(params["blocks"]):
        y, caches[i] = nsa_jax.prefill(blk["attn"], rms_norm(h, blk["norm1"]), mc.nsa,
                                       caches[i], backend=mc.backend)
        h = _block_mlp(blk, h + y)
    return logits_at(params, rms_norm(h[:, -1], params["norm_f"])), caches


@functools.partial(jax.jit, static_argnames=("mc", "decode_backend"))
def _decode_model(params, token, caches, *, mc: ModelConfig, decode_backend: str):
    """Every layer's `nsa_jax.decode_step` for token `[B, 1]` -> (logits `[B, V]`, caches)."""
    h, caches = params["embed"][token], list(caches)
    for i, blk in enumerate(params["blocks"]):
        y, caches[i], _ = nsa_jax.decode_step(blk["attn"], rms_norm(h, blk["norm1"]), mc.nsa,
                                              caches[i], backend=decode_backend)
        h = _block_mlp(blk, h + y)
    return logits_at(params, rms_norm(h[:, -1], params["norm_f"])), caches


def generate(params: dict, prompt: jax.Array, n_new: int, mc: ModelConfig,
             decode_backend: str) -> tuple[jax.Array, jax.Array]:
    """Greedy: prefill `prompt [B, P]` into one cache per layer, then `decode_step` per token.
    -> (tokens int32 `[B, n_new]`, the logits that chose them `[B, n_new, V]`)."""
    if mc.token_shift:
        raise ValueError("generate: a model with a token shift has no decode path "
                         "(ModelConfig.token_shift)")
    B, P = prompt.shape
    caches = [nsa_jax.init_cache(mc.nsa, B, P + n_new) for _ in params["blocks"]]
    logits, caches = _prefill_model(params, prompt, caches, mc=mc)
    chosen, chosen_logits = [], []
    for step in range(n_new):
        if step:
            logits, caches = _decode_model(params, chosen[-1][:, None], caches, mc=mc,
                                           decode_backend=decode_backend)
        chosen.append(jnp.argmax(logits, -1).astype(jnp.int32))
        chosen_logits.append(logits)
    return jnp.stack(chosen, 1), jnp.stack(chosen_logits, 1)


def check_generation(params, batch: dict, task: Task, mc: ModelConfig, n_new: int,
                     decode_backend: str) -> dict:
    """Generate after the first query key and compare with teacher forcing on the generated
    sequence: `gen_match` (fraction of generated tokens equal to the teacher-forced argmax),
    `gen_logit_err` (max |decode - forward| logit over max |logit|), `gen_acc` (first generated
    token = the first query's answer)."""
    tokens = jnp.asarray(batch["tokens"])
    P = tokens.shape[1] - task.tail + 1
    generated, gen_logits = generate(params, tokens[:, :P], n_new, mc, decode_backend)
    sequence = jnp.concatenate([tokens[:, :P], generated[:, :-1]], axis=1)
    forced = logits_at(params, forward_jit(params, sequence, mc)[:, P - 1:])
    return {
        "gen_match": float(jnp.mean(jnp.argmax(forced, -1) == generated)),
        "gen_logit_err": float(jnp.max(jnp.abs(forced - gen_logits))
                               / jnp.maximum(jnp.max(jnp.abs(forced)), 1e-30)),
        "gen_acc": float(jnp.mean(generated[:, 0] == batch["answers"][:, 0])),
    }


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    task: Task
    mc: ModelConfig
    variant: Variant

    @property
    def label(self) -> str:
        return f"nsa:{self.variant.name}" if self.mc.attention == "nsa" else self.mc.attention


def train_run(run: Run, args, vocab: Vocab, limit_s: float, log) -> tuple[list, dict]:
    """Train one model on one task for `args.steps` steps or until `limit_s` seconds pass.
    -> (curve rows, summary row). Every run of a task sees the same batches."""
    task, mc = run.task, run.mc
    seed = args.seed + 1000 * sorted(make_tasks(args.mqar_pairs)).index(task.name)
    data_rng = np.random.default_rng(seed)
    eval_batch = make_batch(np.random.default_rng(seed + 1), task, vocab, args.eval_batch, args.T,
                            mc.nsa, args.shift)
    eval_arrays = [jnp.asarray(eval_batch[k]) for k in ("tokens", "answers", "key_pos")]
    # "paired": NSA starts from the full model's draw (`nsa_from_dense`), so that NSA and full
    # attention differ by the layer alone, not by when their draws leave the MQAR plateau.
    variant = (dataclasses.replace(run.variant, dense_init=True) if args.init == "paired"
               else run.variant)
    params = init_model(jax.random.PRNGKey(args.seed), mc, variant)
    mults = lr_multipliers(params, run.variant)
    opt_state = OPTIMIZER.init(params)

    stages = parse_curriculum(args.curriculum, args.steps)
    rows, t_begin = [], time.perf_counter()
    train_s, compile_s, losses, norms, step = 0.0, 0.0, [], [], 0
    for step in range(args.steps):
        T = length_at(step, stages, args.T)
        batch = make_batch(data_rng, task, vocab, args.batch, T, mc.nsa, args.shift)
        lr = learning_rate(step, args.lr, args.warmup, args.steps)
        new_length = step == 0 or T != length_at(step - 1, stages, args.T)
        if new_length and step > 0:
            # A new sequence length compiles a new step: keep that out of the training time.
            jax.block_until_ready(params)
            train_s += time.perf_counter() - t_mark
        t0 = time.perf_counter()
        params, opt_state, loss, norm = train_step(params, opt_state, batch["tokens"],
                                                   batch["answers"], jnp.float32(lr), mults,
                                                   mc=mc, task=task)
        losses.append(loss)
        norms.append(norm)
        if new_length:
            # The first step at each length compiles; it is not part of the training time.
            loss.block_until_ready()
            compile_s += time.perf_counter() - t0
            t_mark = time.perf_counter()
        last = step == args.steps - 1 or time.perf_counter() - t_begin > limit_s
        if step % args.eval_every == 0 or last:
            jax.block_until_ready(params)
            if step > 0 and not new_length:
                train_s += time.perf_counter() - t_mark
            stats = in_chunks(functools.partial(evaluate, params, mc=mc, task=task),
                              eval_arrays, args.eval_chunk)
            train_loss = float(jnp.mean(jnp.stack(losses)))
            grads = {k: float(np.mean([n[k] for n in norms])) for k in norms[0]}
            losses, norms = [], []
            rows.append(dict(task=task.name, model=run.label, step=step + 1, T=T,
                             train_s=round(train_s, 3), train_loss=train_loss,
                             eval_loss=stats.pop("loss"), eval_acc=stats.pop("acc"), **stats,
                             **grads))
            log(f"  {task.name:6s} {run.label:18s} step {step + 1:5d}  T {T:5d}  loss "
                f"{train_loss:.3f}  acc {rows[-1]['eval_acc']:.3f}  " + "  ".join(
                    f"{k} {v:.2f}" for k, v in stats.items() if not k.endswith("_uniform"))
                + ("  grad " + " ".join(f"{k} {v:.2g}" for k, v in grads.items())
                   if grads else ""))
            t_mark = time.perf_counter()
            if not math.isfinite(train_loss) or last:
                break

    final = rows[-1]
    # Retrieval may live in any layer (on CPU at T 128 it was layer 0): report the layer whose
    # selection finds the key most often.
    hit_layer = max(range(mc.n_layers), key=lambda i: final.get(f"l{i}_hit", 0.0))
    top = f"l{hit_layer}"
    summary = dict(task=task.name, model=run.label, steps=final["step"],
                   final_acc=final["eval_acc"], best_acc=max(r["eval_acc"] for r in rows),
                   final_loss=final["eval_loss"], train_s=final["train_s"],
                   ms_per_step=1e3 * final["train_s"] / max(1, final["step"] - 1),
                   compile_s=round(compile_s, 2), hit=final.get(f"{top}_hit"),
                   gate_sel=final.get(f"{top}_gate_sel"), cmp_mass=final.get(f"{top}_cmp_mass"))
    if mc.attention == "full":
        # The layer that retrieves (most attention mass on the key's block) and its probe.
        layer = max(range(mc.n_layers), key=lambda i: final[f"l{i}_key_mass"])
        summary.update(probe_layer=layer, key_mass=final[f"l{layer}_key_mass"],
                       **{f"{n}_hit": final[f"l{layer}_{n}_hit"] for n, _ in PROBE_POOLS},
                       hit_chance=selection_chance(task, args.T, mc.nsa))
    if mc.attention == "nsa":
        summary["hit_layer"] = hit_layer
        summary["hit_chance"] = selection_chance(task, args.T, mc.nsa)
        if args.ablate:
            ablation = in_chunks(functools.partial(ablation_accuracy, params, mc=mc, task=task),
                                 eval_arrays, args.eval_chunk)
            summary.update(ablation)
            log(f"  {task.name:6s} {run.label:18s} key blocks out of the selection: " + "  ".join(
                f"{k} {v:.3f}" for k, v in ablation.items()))
        if args.gen_tokens > 0 and not mc.token_shift:
            gen = check_generation(params, {k: v[:args.gen_batch] for k, v in eval_batch.items()},
                                   task, mc, args.gen_tokens, args.decode_backend)
            summary.update(gen)
            log(f"  {task.name:6s} {run.label:18s} decode: " + "  ".join(
                f"{k} {v:.3g}" for k, v in gen.items()))
    return rows, summary


def acc_at_wall(rows: list, wall_s: float) -> Optional[float]:
    """Eval accuracy of the last evaluation within `wall_s` seconds of training."""
    within = [r for r in rows if r["train_s"] <= wall_s + 1e-9]
    return within[-1]["eval_acc"] if within else None


SUMMARY_COLUMNS = ("task", "model", "steps", "final_acc", "best_acc", "acc_at_full_wall",
                   "acc_at_full_steps", "final_loss", "ms_per_step", "compile_s", "train_s",
                   "hit_layer", "hit", "hit_chance", "gate_sel", "cmp_mass", "probe_layer",
                   "key_mass", *(f"{name}_hit" for name, _ in PROBE_POOLS),
                   *(f"acc_excl_{label}" for label, _, _ in ABLATIONS), "gen_match",
                   "gen_logit_err", "gen_acc")


def equal_budget_columns(curves: dict, summaries: list) -> None:
    """Fill acc_at_full_wall / acc_at_full_steps: each model's accuracy at the training time
    and at the step count that full attention used on the same task."""
    for s in summaries:
        ref = next((r for r in summaries if r["task"] == s["task"] and r["model"] == "full"), None)
        if ref is None:
            continue
        rows = curves[(s["task"], s["model"])]
        s["acc_at_full_wall"] = acc_at_wall(rows, ref["train_s"])
        at_steps = [r for r in rows if r["step"] <= ref["steps"]]
        s["acc_at_full_steps"] = at_steps[-1]["eval_acc"] if at_steps else None


def plot(path: str, curves: dict, tasks: list, n_layers: int) -> None:
    """One row of panels per task: accuracy against steps and training time, and per NSA layer
    the selection hit rate and the sel gate against steps."""
    import matplotlib

    from bench import common

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("step", ("eval_acc",), "accuracy vs steps"),
              ("train_s", ("eval_acc",), "accuracy vs training time (s)"),
              ("step", tuple(f"l{i}_hit" for i in range(n_layers)), "selection hit rate"),
              ("step", tuple(f"l{i}_gate_sel" for i in range(n_layers)), "sel gate at queries"))
    fig, axes = plt.subplots(len(tasks), len(panels), figsize=(4.6 * len(panels), 3.6 * len(tasks)),
                             squeeze=False)
    for row, task in zip(axes, tasks):
        for ax, (x, ys, title) in zip(row, panels):
            for (name, label), points in sorted(curves.items()):
                for y in ys:
                    if name == task and y in points[0]:
                        suffix = f" {y.split('_')[0]}" if len(ys) > 1 else ""
                        ax.plot([p[x] for p in points], [p[y] for p in points], marker=".",
                                label=label + suffix)
            ax.set_title(f"{task}: {title}", fontsize=9)
            ax.set_xlabel(x)
    common.save_panels(fig, axes.flat, path)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
PRESETS = {
    # GPU: T 2048, a small model (d_model 256, H 8, G 2, d 32) with the paper's block ratios;
    # MQAR with 32 pairs over 16 values, a curriculum (T 512 to step 400, 1024 to step 800, then
    # 2048), 1200 steps; sized for `--tasks mqar --models full,window,nsa --variants
    # default,sel_only` (4 runs) within --budget_s 280 on one H100 (RECALL_NOTES.md, section 0).
    "gpu": dict(T=2048, batch=16, steps=1200, eval_every=100, lr=3e-3, warmup=100,
                d_model=256, n_layers=2, heads=8, kv_heads=2, head_dim=32, cmp_block=32,
                cmp_stride=16, sel_block=64, n_sel=8, window=128, mqar_pairs=32, n_values=16,
                curriculum="512:400,1024:800", shift="none", rope_theta=10000.0,
                budget_s=280.0, backend="pallas,xla", decode_backend="pallas"),
    # CPU: a few minutes at T 256 (the same ratios, 4x smaller blocks).
    "cpu": dict(T=256, batch=16, steps=400, eval_every=50, lr=3e-3, warmup=50,
                d_model=64, n_layers=2, heads=4, kv_heads=2, head_dim=16, cmp_block=8,
                cmp_stride=4, sel_block=16, n_sel=4, window=32, mqar_pairs=8, n_values=64,
                curriculum="", shift="none", rope_theta=10000.0, budget_s=600.0,
                backend="xla", decode_backend="xla"),
    # The test suite's smoke: seconds.
    "smoke": dict(T=128, batch=8, steps=6, eval_every=3, lr=1e-2, warmup=1,
                  d_model=32, n_layers=1, heads=2, kv_heads=1, head_dim=8, cmp_block=8,
                  cmp_stride=4, sel_block=16, n_sel=4, window=16, mqar_pairs=8, n_values=64,
                  curriculum="", shift="none", rope_theta=10000.0, budget_s=120.0,
                  backend="xla", decode_backend="xla"),
}
HELP = {
    "curriculum": "T:until_step,... train shorter sequences first, e.g. 512:400,1024:800 "
                  "(T 512 to step 400, 1024 to 800, then --T); empty: none",
    "shift": f"where keys sit in their selection block, one of {SHIFTS} (pair_slots)",
    "rope_theta": "RoPE base of every model; 0: no RoPE",
    "budget_s": "wall-clock limit of the whole script (compiles included), shared among runs",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--tasks", default="needle,mqar")
    parser.add_argument("--models", default="full,window,nsa",
                        help=f"comma list of {ATTENTIONS}")
    parser.add_argument("--variants", default="default",
                        help=f"NSA variants, comma list of {sorted(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_batch", type=int, default=64)
    parser.add_argument("--eval_chunk", type=int, default=32,
                        help="eval rows run at once (memory: full attention at T 2048 takes "
                             "about 0.25 GB a row); the figures do not depend on it")
    parser.add_argument("--gen_batch", type=int, default=8)
    parser.add_argument("--init", choices=("paired", "own"), default="paired",
                        help="paired: every NSA run starts from the full model's initial "
                             "weights for the parameters they share (embeddings, norms, MLPs, "
                             "head, wq, wk/wv['sel'], wo); own: NSA's own draw (as the "
                             "earliest recorded runs did)")
    parser.add_argument("--ablate", action="store_true",
                        help="NSA runs: also evaluate with the queried keys' blocks removed from "
                             "the selection of the first, the last and every layer, at every "
                             "query, at the answers' positions or elsewhere (acc_excl_* "
                             "columns, `ABLATIONS`)")
    parser.add_argument("--token_shift", action="store_true",
                        help="a learned token shift before each attention (ModelConfig."
                             "token_shift); no generation check then")
    parser.add_argument("--gen_tokens", type=int, default=4,
                        help="greedy tokens generated through the decode cache (0: no check)")
    for name, value in PRESETS["gpu"].items():
        parser.add_argument(f"--{name}", type=type(value), default=None,
                            help=f"{HELP.get(name, '')} (preset value if omitted; gpu: "
                                 f"{value!r})".lstrip())
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    curriculum_given = args.curriculum is not None
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.eval_chunk <= 0:
        parser.error(f"--eval_chunk ({args.eval_chunk}) must be positive")
    if args.shift not in SHIFTS:
        parser.error(f"--shift ({args.shift!r}) must be one of {SHIFTS}")
    if not curriculum_given:
        args.curriculum = fit_curriculum(args.curriculum, preset["steps"], args.steps, args.T)
    parse_curriculum(args.curriculum, args.steps)
    return args


def fit_curriculum(text: str, preset_steps: int, steps: int, T: int) -> str:
    """The preset's curriculum for another --steps / --T (e.g. the runner's showcase, T 1024 in
    400 steps): stage ends scaled by steps / preset_steps, stages not shorter than T dropped."""
    stages = [(t, max(1, round(until * steps / preset_steps)))
              for t, until in parse_curriculum(text, preset_steps) if t < T]
    kept = [stage for i, stage in enumerate(stages) if i == 0 or stage[1] > stages[i - 1][1]]
    return ",".join(f"{t}:{until}" for t, until in kept if until < steps)


def build_runs(args) -> tuple[list[Run], Vocab]:
    tasks = make_tasks(args.mqar_pairs)
    vocab = Vocab(n_keys=max(64, args.mqar_pairs), n_values=args.n_values)
    cfg = NSAConfig(d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads,
                    d_k=args.head_dim, d_v=args.head_dim, cmp_block=args.cmp_block,
                    cmp_stride=args.cmp_stride, sel_block=args.sel_block, n_sel=args.n_sel,
                    window=args.window, rope_theta=args.rope_theta if args.rope_theta > 0 else None)
    backend = tuple(args.backend.split(","))
    runs = []
    for name in args.tasks.split(","):
        if name not in tasks:
            raise ValueError(f"task ({name!r}) must be one of {sorted(tasks)}")
        for attention in args.models.split(","):
            if attention not in ATTENTIONS:
                raise ValueError(f"model ({attention!r}) must be one of {ATTENTIONS}")
            variants = ([VARIANTS[v] for v in args.variants.split(",")] if attention == "nsa"
                        else [Variant()])
            for variant in variants:
                mc = ModelConfig(attention, variant_cfg(cfg, variant), vocab.size,
                                 n_layers=args.n_layers, backend=backend,
                                 token_shift=getattr(args, "token_shift", False))
                runs.append(Run(tasks[name], mc, variant))
    return runs, vocab


def check_lengths(runs, args) -> None:
    """Every task must fit at every length the curriculum trains on, checked before the first
    run (a task that does not fit would otherwise stop the script after the runs before it,
    with none of their results written)."""
    lengths = sorted({T for T, _ in parse_curriculum(args.curriculum, args.steps)} | {args.T})
    for run in runs:
        for T in lengths:
            try:
                pair_region(run.task, T, run.mc.nsa)
            except ValueError as exc:
                raise ValueError(f"--curriculum / --T: task {run.task.name!r} at T = {T}: "
                                 f"{exc}") from None


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise ValueError(f"variant ({v!r}) must be one of {sorted(VARIANTS)}")
    runs, vocab = build_runs(args)
    check_lengths(runs, args)
    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(text):
        print(text, flush=True)
        lines.append(text)

    log(f"devices {jax.devices()}; {len(runs)} runs, T {args.T}, batch {args.batch}, "
        f"steps {args.steps}, curriculum {args.curriculum or 'none'}, shift {args.shift}, "
        f"rope_theta {args.rope_theta or 'off'}, budget {args.budget_s:.0f} s")
    t_begin = time.perf_counter()
    curves, summaries = {}, []
    for i, run in enumerate(runs):
        # Share what is left of the budget among the runs still to go (compiles included).
        limit_s = (args.budget_s - (time.perf_counter() - t_begin)) / (len(runs) - i)
        rows, summary = train_run(run, args, vocab, limit_s, log)
        curves[(run.task.name, run.label)] = rows
        summaries.append(summary)
    equal_budget_columns(curves, summaries)
    write_outputs(args, runs, curves, summaries, lines, time.perf_counter() - t_begin)
    return summaries


def write_outputs(args, runs, curves, summaries, log_lines, total_s) -> None:
    from bench import common

    columns: list[str] = []
    for rows in curves.values():
        for key in rows[0]:
            if key not in columns:
                columns.append(key)
    common.write_csv(os.path.join(args.out, "curves.csv"),
                     [r for rows in curves.values() for r in rows], columns)
    common.write_csv(os.path.join(args.out, "summary.csv"), summaries, SUMMARY_COLUMNS)
    shown = [c for c in SUMMARY_COLUMNS if any(s.get(c) is not None for s in summaries)]
    table = common.format_table([[s.get(c) for c in shown] for s in summaries], shown)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# train_recall ({args.preset}: T {args.T}, batch {args.batch}, "
                f"{args.steps} steps max, {total_s:.0f} s)\n\n")
        f.write("| " + " | ".join(shown) + " |\n|" + "---|" * len(shown) + "\n")
        for s in summaries:
            f.write("| " + " | ".join(common._cell(s.get(c)) for c in shown) + " |\n")
        f.write(f"\nchance accuracy 1/{args.n_values} = {1 / args.n_values:.3f}\n")
    plot(os.path.join(args.out, "curves.png"), curves, sorted({r.task.name for r in runs}),
         args.n_layers)
    common.write_environment(os.path.join(args.out, "stats.json"), dict(
        args=vars(args), total_s=total_s, summaries=summaries,
        runs=[dict(task=r.task.name, model=r.label, variant=dataclasses.asdict(r.variant),
                   nsa=dataclasses.asdict(r.mc.nsa)) for r in runs],
        log=log_lines))
    print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
