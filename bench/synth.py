"""Synthetic trace of a TP decode run, written record for record as the real tracer writes it.

The model is a DeepSeek/Llama-sized dense decoder with the module tree of
``examples/tp_llama.py``: ``model.embed_tokens`` (vocab-parallel, all_reduce), 61 decoder layers
``model.layers.i`` = {input_layernorm, self_attn{qkv_proj, attn, o_proj (row parallel,
all_reduce inside)}, post_attention_layernorm, mlp{gate_up_proj, act_fn, down_proj (row parallel,
all_reduce inside)}}, ``model.norm``, ``lm_head`` (vocab-parallel, local logits), then one list
``all_gather`` of the logits issued by the root. Per step and rank: 676 module spans and
2 * 61 + 2 = 124 collectives (800 span records). Shapes are those of a TP decode step (hidden 7168,
56 query heads and 8 KV heads of 128, ffn 18432, vocab 129280, batch 8, 1 token), bf16 on
``cuda:RANK``.

What the tracer does is replayed with the real ``RankWriter``: the same records in the same order
(HEADER; IDENTITY; PARAMS of every module with weights, before step 0; IDENTITY with the device;
then per step STEP_BEGIN, SPAN records at each module's exit, COLLECTIVE records at each
collective's end, GROUP before the first collective, STEP_END, FINGERPRINTS; END at close), the
same interning (``writer.module``/``string``/``layout`` at the moments the tracer calls them),
the same fingerprint index order (a call's inputs when it begins, its outputs when it ends; a
collective's inputs when it begins, outputs when it ends), the fingerprint records of
``tracer/fingerprint.py`` (small CUDA tensors deferred and written per (shape, dtype) block with
their u32 indices, immediate values in one block, cache hits in a block of their own), and a flush
per second of (simulated) time, as the writer's flush thread would do it (the writer cuts each
flush into chunks of its own size).

Fingerprints (fp32 sum, sum of squares) are drawn per step so that the placements hold:
replicated tensors have the same fingerprint on every rank; an all_reduce's per-rank inputs
add up to its output, which is also the output of o_proj / down_proj / embed_tokens; the
all_gather's outputs are the ranks' lm_head outputs and the root's logits their concatenation;
qkv_proj / attn / gate_up_proj / act_fn / lm_head outputs differ per rank; column/row-parallel
and embedding weights differ per rank, norm weights are equal.

``--fp-spread realistic`` (default) draws per-rank tensors with the statistics of iid values (the
sum of n values of rms s is N(0, sqrt(n) s); the sum of squares n s^2 (1 + N(0, sqrt(2/n)))), which
is what column-parallel slices of a random weight give; ``wide`` spreads the per-rank sums of
squares by +-40% so that no fingerprint tolerance can mistake them for equal.

    python bench/synth.py --steps 20 --ranks 8 --out /tmp/tt-synth
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import socket
import struct
import time

import numpy as np

from tensor_trace import schema
from tensor_trace.tracer.writer import RankWriter

BF16 = "bfloat16"
I64 = "int64"

# ---------------------------------------------------------------------------- model shape


@dataclasses.dataclass
class Shape:
    layers: int = 61
    hidden: int = 7168
    heads: int = 56
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 18432
    vocab: int = 129280
    batch: int = 8
    tokens: int = 1

    def check(self, tp: int) -> None:
        bad = [f"{n} {v}" for n, v in (("heads", self.heads), ("ffn", self.ffn), ("vocab", self.vocab))
               if v % tp]
        if bad:
            raise SystemExit(f"--ranks {tp} must divide {', '.join(bad)}")

    def spans_per_step(self) -> int:
        return 11 * self.layers + 5  # root, model, embed_tokens, norm, lm_head + 11 per layer

    def collectives_per_step(self) -> int:
        return 2 * self.layers + 2


def steps_for(total_span_records: int, ranks: int, shape: Shape | None = None) -> int:
    """Steps giving about ``total_span_records`` span records (module spans + collectives)."""
    shape = shape or Shape()
    per = shape.spans_per_step() + shape.collectives_per_step()
    return max(1, round(total_span_records / (ranks * per)))


# ---------------------------------------------------------------------------- values
# Kinds of logical tensors; the fingerprint of each is drawn per step (per rank where it differs).
REP, SHARD, PARTIAL, GATHERED, CONCAT, TOKENS, EMB, EMB_PART = range(8)


class Values:
    """Logical tensors of one step and their fingerprints on every rank."""

    def __init__(self, ranks: int, vocab: int, hidden: int, spread: str):
        self.ranks = ranks
        self.vocab = vocab
        self.hidden = hidden
        self.wide = spread == "wide"
        self.items: list = []  # (kind, numel, rms, arg)

    def _new(self, kind, numel, rms, arg=None) -> int:
        self.items.append((kind, numel, rms, arg))
        return len(self.items) - 1

    def rep(self, numel, rms):
        return self._new(REP, numel, rms)

    def shard(self, numel, rms):
        return self._new(SHARD, numel, rms)

    def partial(self, out):
        return self._new(PARTIAL, self.items[out][1], self.items[out][2], out)

    def gathered(self, src, j):
        return self._new(GATHERED, self.items[src][1], self.items[src][2], (src, j))

    def concat(self, src):
        return self._new(CONCAT, self.items[src][1] * self.ranks, self.items[src][2], src)

    def tokens(self, numel):
        return self._new(TOKENS, numel, 0.0)

    def embedding(self, tokens, rms):
        out = self._new(EMB, self.items[tokens][1] * self.hidden, rms, tokens)
        part = self._new(EMB_PART, self.items[out][1], rms, out)
        return out, part

    def draw(self, seed: int) -> np.ndarray:
        """Fingerprints [n logical, ranks, 2] (float32) of one step."""
        rng = np.random.default_rng(seed)
        R = self.ranks
        V = np.zeros((len(self.items), R, 2), dtype=np.float64)
        token_rows: dict = {}
        for i, (kind, n, rms, arg) in enumerate(self.items):
            if kind == REP:
                V[i, :, 0] = rng.normal() * math.sqrt(n) * rms
                V[i, :, 1] = n * rms * rms * (1 + rng.normal() * math.sqrt(2 / n))
            elif kind == SHARD:
                V[i, :, 0] = rng.normal(size=R) * math.sqrt(n) * rms * (4 if self.wide else 1)
                q = n * rms * rms * (1 + rng.normal(size=R) * math.sqrt(2 / n))
                if self.wide:
                    q *= rng.uniform(0.6, 1.4, size=R)
                V[i, :, 1] = q
            elif kind == PARTIAL:
                S, Q = V[arg, 0]
                s = rng.normal(size=R) * math.sqrt(n / R) * rms
                V[i, :, 0] = s + (S - s.sum()) / R
                q = Q / R * (1 + rng.normal(size=R) * math.sqrt(2 / n))
                if self.wide:
                    q *= rng.uniform(0.6, 1.4, size=R)
                V[i, :, 1] = q
            elif kind == GATHERED:
                src, j = arg
                V[i, :, :] = V[src, j, :]
            elif kind == CONCAT:
                V[i, :, 0] = V[arg, :, 0].sum()
                V[i, :, 1] = V[arg, :, 1].sum()
            elif kind == TOKENS:
                ids = rng.integers(0, self.vocab, size=n)
                token_rows[i] = ids
                V[i, :, 0] = float(ids.sum())
                V[i, :, 1] = float((ids.astype(np.float64) ** 2).sum())
            elif kind == EMB:
                ids = token_rows[arg]
                H = self.hidden
                s_t = rng.normal(size=len(ids)) * math.sqrt(H) * rms
                q_t = H * rms * rms * (1 + rng.normal(size=len(ids)) * math.sqrt(2 / H))
                owner = ids // (self.vocab // R)
                token_rows[i] = (owner, s_t, q_t)
                V[i, :, 0] = s_t.sum()
                V[i, :, 1] = q_t.sum()
            elif kind == EMB_PART:
                owner, s_t, q_t = token_rows[arg]
                for r in range(R):
                    m = owner == r
                    V[i, r, 0] = s_t[m].sum()
                    V[i, r, 1] = q_t[m].sum()
        return V.astype("<f4")


# ---------------------------------------------------------------------------- structure


@dataclasses.dataclass
class Coll:
    op: str
    inputs: list  # [(slot, shape, dtype, logical id)]
    outputs: list
    dur_us: float
    reducing: bool


@dataclasses.dataclass
class Node:
    path: str
    cls: str
    inputs: list  # [(slot, shape, dtype, logical id)]
    outputs: list
    body: list  # Node | Coll | float (host time in µs spent in the module's own code)


def build(shape: Shape, tp: int, spread: str):
    """The module tree of one step (identical on every rank) and its logical tensors."""
    V = Values(tp, shape.vocab, shape.hidden, spread)
    B, T, H = shape.batch, shape.tokens, shape.hidden
    nq = shape.heads // tp * shape.head_dim
    nkv = max(1, shape.kv_heads // tp) * shape.head_dim
    f = shape.ffn // tp
    vl = shape.vocab // tp
    n = B * T
    act = (B, T, H)

    ids = V.tokens(n)
    emb, emb_part = V.embedding(ids, 0.02)
    embed = Node("model.embed_tokens", "VocabParallelEmbedding", [("input.0", (B, T), I64, ids)],
                 [("output", act, BF16, emb)],
                 [18.0, Coll("all_reduce", [("input.0", act, BF16, emb_part)],
                             [("output.0", act, BF16, emb)], 25.0, True)])
    layers = []
    h = emb
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        rms_h = 0.5 + 0.05 * i
        n1 = V.rep(n * H, 1.0)
        qkv = V.shard(n * (nq + 2 * nkv), 1.7)
        q, k, v = V.shard(n * nq, 1.7), V.shard(n * nkv, 1.7), V.shard(n * nkv, 1.7)
        a = V.shard(n * nq, 0.5)
        o = V.rep(n * H, 0.3)
        o_part = V.partial(o)
        h2 = V.rep(n * H, rms_h)
        n2 = V.rep(n * H, 1.0)
        gu = V.shard(n * 2 * f, 1.7)
        ac = V.shard(n * f, 0.5)
        d = V.rep(n * H, 0.3)
        d_part = V.partial(d)
        h3 = V.rep(n * H, rms_h + 0.02)
        X = lambda lid, shp=act: [("input.0", shp, BF16, lid)]  # noqa: E731
        Y = lambda lid, shp=act: [("output", shp, BF16, lid)]  # noqa: E731
        attn = Node(f"{p}.self_attn", "LlamaAttention", X(n1), Y(o), [
            Node(f"{p}.self_attn.qkv_proj", "QKVParallelLinear", X(n1), Y(qkv, (B, T, nq + 2 * nkv)), [20.0]),
            4.0,
            Node(f"{p}.self_attn.attn", "CoreAttention",
                 [("input.0", (B, T, nq), BF16, q), ("input.1", (B, T, nkv), BF16, k),
                  ("input.2", (B, T, nkv), BF16, v)], Y(a, (B, T, nq)), [60.0]),
            Node(f"{p}.self_attn.o_proj", "RowParallelLinear", X(a, (B, T, nq)), Y(o), [
                18.0, Coll("all_reduce", [("input.0", act, BF16, o_part)], [("output.0", act, BF16, o)],
                           25.0, True)]),
        ])
        mlp = Node(f"{p}.mlp", "LlamaMLP", X(n2), Y(d), [
            Node(f"{p}.mlp.gate_up_proj", "MergedColumnParallelLinear", X(n2), Y(gu, (B, T, 2 * f)), [20.0]),
            Node(f"{p}.mlp.act_fn", "SiluAndMul", X(gu, (B, T, 2 * f)), Y(ac, (B, T, f)), [10.0]),
            Node(f"{p}.mlp.down_proj", "RowParallelLinear", X(ac, (B, T, f)), Y(d), [
                18.0, Coll("all_reduce", [("input.0", act, BF16, d_part)], [("output.0", act, BF16, d)],
                           25.0, True)]),
        ])
        layers.append(Node(p, "LlamaDecoderLayer", X(h), Y(h3), [
            Node(f"{p}.input_layernorm", "RMSNorm", X(h), Y(n1), [15.0]),
            attn, 3.0,
            Node(f"{p}.post_attention_layernorm", "RMSNorm", X(h2), Y(n2), [15.0]),
            mlp, 3.0,
        ]))
        h = h3
    nf = V.rep(n * H, 1.0)
    logits_local = V.shard(n * vl, 2.0)
    gathered = [V.gathered(logits_local, j) for j in range(tp)]
    logits = V.concat(logits_local)
    model = Node("model", "LlamaModel", [("input.0", (B, T), I64, ids)], [("output", act, BF16, nf)],
                 [embed, *layers, Node("model.norm", "RMSNorm", [("input.0", act, BF16, h)],
                                       [("output", act, BF16, nf)], [15.0])])
    lm_head = Node("lm_head", "ParallelLMHead", [("input.0", act, BF16, nf)],
                   [("output", (B, T, vl), BF16, logits_local)], [25.0])
    root = Node("", "TinyLlamaForCausalLM", [("input.0", (B, T), I64, ids)],
                [("output", (B, T, vl * tp), BF16, logits)], [
                    model, lm_head,
                    Coll("all_gather", [("input.0", (B, T, vl), BF16, logits_local)],
                         [(f"output.{j}", (B, T, vl), BF16, gathered[j]) for j in range(tp)], 40.0, False),
                    12.0])
    # Weights: (module path, class, [(name, shape, sharded)]), in root.modules() order.
    params = [("model.embed_tokens", "VocabParallelEmbedding", [("weight", (vl, H), True)])]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        params += [(f"{p}.input_layernorm", "RMSNorm", [("weight", (H,), False)]),
                   (f"{p}.self_attn.qkv_proj", "QKVParallelLinear", [("weight", (nq + 2 * nkv, H), True)]),
                   (f"{p}.self_attn.o_proj", "RowParallelLinear", [("weight", (H, nq), True)]),
                   (f"{p}.post_attention_layernorm", "RMSNorm", [("weight", (H,), False)]),
                   (f"{p}.mlp.gate_up_proj", "MergedColumnParallelLinear", [("weight", (2 * f, H), True)]),
                   (f"{p}.mlp.down_proj", "RowParallelLinear", [("weight", (H, f), True)])]
    params += [("model.norm", "RMSNorm", [("weight", (H,), False)]),
               ("lm_head", "ParallelLMHead", [("weight", (vl, H), True)])]
    return root, V, params


def param_fingerprints(params, tp: int, seed: int) -> np.ndarray:
    """[n params, ranks, 2]: norm weights (1 + 0.02 N) equal on every rank, slices (0.02 N) not."""
    rng = np.random.default_rng(seed)
    rows = []
    for _path, _cls, plist in params:
        for _name, shp, sharded in plist:
            n = math.prod(shp)
            if sharded:
                s = rng.normal(size=tp) * 0.02 * math.sqrt(n)
                q = n * 4e-4 * (1 + rng.normal(size=tp) * math.sqrt(2 / n))
            else:
                s = np.full(tp, n + rng.normal() * 0.02 * math.sqrt(n))
                q = np.full(tp, n * (1 + 4e-4) + rng.normal() * 0.04 * math.sqrt(n))
            rows.append(np.stack([s, q], axis=-1))
    return np.stack(rows).astype("<f4")


# ---------------------------------------------------------------------------- one rank

DEFER_MAX_NUMEL = 1 << 20  # tracer/fingerprint.py: larger CUDA tensors are reduced at once


class _FpModel:
    """Index bookkeeping of the tracer's ``StepFingerprints`` for CUDA tensors under
    ``inference_mode``: a value stored by an output (``store=True``) is reused once by the next
    call that sees the same tensor (a *dup*); floating tensors of at most ``DEFER_MAX_NUMEL``
    elements are deferred and reduced per (shape, dtype) at the end of the step; integer tensors,
    large ones, and a collective's inputs (``materialize``: it updates them in place) are
    immediate. ``plan`` lists the FINGERPRINTS records of the step: (first index, logical ids of
    the values, packed u32 indices or None): one, in index order, as format 2 writes them."""

    def __init__(self):
        self.count = 0
        self.seen: dict = {}  # logical id -> index of the stored value
        self.groups: dict = {}  # (shape, dtype) -> [(index, logical id)]
        self.imm: list = []
        self.dups: list = []

    def add(self, entries, store, materialize=False) -> int:
        base = idx = self.count
        for shape, dtype, lid in entries:
            src = self.seen.pop(lid, None)
            if src is not None:
                self.dups.append((idx, lid))
            else:
                if dtype != I64 and not materialize and math.prod(shape) <= DEFER_MAX_NUMEL:
                    self.groups.setdefault((shape, dtype), []).append((idx, lid))
                else:
                    self.imm.append((idx, lid))
                if store:
                    self.seen[lid] = idx
            idx += 1
        self.count = idx
        return base

    def plan(self) -> list:
        # Format 2 (tracer/fingerprint.py, _step_records): every value of the step, repeats
        # included, in index order: one record, without indices when they have no gap.
        block = sorted([*(e for group in self.groups.values() for e in group), *self.imm, *self.dups])
        if not block:
            return []
        idx = [i for i, _ in block]
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        packed = None if contiguous else struct.pack(f"<{len(idx)}I", *idx)
        return [(idx[0], [lid for _, lid in block], packed)]



class _Rank:
    """The tracer of one rank: its writer, clock, step counters and fingerprint indices."""

    FLUSH_NS = 1_000_000_000

    def __init__(self, out_dir, run_id, rank, tp, host, pid, mono0, wall0, argv):
        self.rank = rank
        self.dev = f"cuda:{rank}"
        path = os.path.join(out_dir, "ranks", f"{host}-{pid}{schema.RANK_FILE_SUFFIX}")
        header = dict(format=schema.FORMAT_VERSION, run_id=run_id, pid=pid, ppid=pid - 1 - rank, host=host,
                      argv=argv, mono_ns=mono0, wall_ns=wall0, clock_offset_ns=0, torch="2.8.0+cu128",
                      config=dict(modules=[], exclude=[], steps=[0, None], fingerprint=True))
        # No flush thread: chunks are cut at every second of simulated time, as it would cut them.
        self.w = RankWriter(path, header, flush_interval_s=3600)
        self.path = path
        self.next_flush = mono0 + self.FLUSH_NS
        self.identity = dict(rank=rank, world_size=tp, local_rank=rank, backend="nccl")
        self.w.add((schema.IDENTITY, dict(self.identity)))
        self.stats = dict(steps=0, steps_skipped=0, spans=0, collectives=0, errors=0,
                          dropped_spans=0, foreign_thread_calls=0)
        self.gid = None
        self.seq = 0
        self.step_meta: dict = {}  # per step: arrays built once for this rank
        self.fp_records = 0

    def params(self, params, pfp: np.ndarray) -> None:
        w = self.w
        i = 0
        for path, cls, plist in params:
            entries = []
            for name, shp, _sharded in plist:
                entries.append([w.string(name), w.meta(shp, BF16, self.dev), i])
                i += 1
            w.add((schema.PARAMS, w.module(path, cls), entries))
        # StepFingerprints of the parameters: small CUDA tensors (the norm weights) deferred and
        # reduced per shape, the large ones at once; blocks: deferred groups, then the immediate.
        fp = _FpModel()
        for _path, _cls, plist in params:
            for _name, shp, _sharded in plist:
                fp.add([(shp, BF16, fp.count)], store=False)
        self.pending_params = [(first, np.asarray(lids, dtype=np.intp), packed)
                               for first, lids, packed in fp.plan()]
        self.pfp = pfp

    def maybe_flush(self, t):
        if t >= self.next_flush:
            self.w.flush()
            self.next_flush = t + self.FLUSH_NS

    def run_step(self, step, root, V32, times):
        """Replay one step; ``times`` is this rank's event clock (one value per event)."""
        w = self.w
        add = w.add
        rank = self.rank
        dev = self.dev
        self._t = iter(times)
        nxt = self._t.__next__
        fp = _FpModel()  # the tracer's StepFingerprints: indices, cache hits, blocks
        fp_add = fp.add
        calls: dict = {}
        count = [0, 0]  # spans, collectives
        first = step == 0 and "device" not in self.identity
        # _begin_step
        t_step = nxt()
        root_id = w.module(root.path, root.cls)
        if first:
            self.identity["device"] = dev
            add((schema.IDENTITY, dict(self.identity)))
        add((schema.STEP_BEGIN, step, root_id, t_step, {}))
        S_SPAN, S_COLL, S_GROUP = schema.SPAN, schema.COLLECTIVE, schema.GROUP
        layout = w.layout
        module = w.module
        string = w.string

        def coll(c: Coll, parent):
            t0 = nxt()
            if self.gid is None:  # _group_seq: the GROUP record before the first use
                self.gid = 0
                add((S_GROUP, 0, "world", list(range(len(self.all_ranks))), "nccl", "0"))
            seq = self.seq
            self.seq += 1
            index = count[1]
            count[1] += 1
            fp_pre = fp_add([(shp, dt, lid) for _, shp, dt, lid in c.inputs], False, materialize=True)
            t1 = nxt()
            fp_post = fp_add([(shp, dt, lid) for _, shp, dt, lid in c.outputs], True)
            slots = [(s, shp, dt, dev) for s, shp, dt, _ in c.inputs] + [
                (s, shp, dt, dev) for s, shp, dt, _ in c.outputs]
            lay = layout(tuple(slots))
            nbytes = sum(math.prod(shp) * 2 for _, shp, _, _ in c.inputs)
            redop = string("sum") if c.reducing else -1
            add((S_COLL, step, index, parent, string(c.op), redop, 0, seq, t0 - t_step, t1 - t0, lay,
                 fp_pre, fp_post, len(c.inputs), 0, nbytes))

        def span(node: Node, parent, t0=None):
            if t0 is None:
                t0 = nxt()
            pid = module(node.path, node.cls)
            call = calls.get(pid, -1) + 1
            calls[pid] = call
            index = count[0]
            count[0] += 1
            ins = node.inputs
            fp_pre = -1
            if ins:
                fp_pre = fp_add([(shp, dt, lid) for _, shp, dt, lid in ins], False)
            for item in node.body:
                if item.__class__ is Node:
                    span(item, index)
                elif item.__class__ is Coll:
                    coll(item, index)
            t1 = nxt()
            outs = node.outputs
            fp_post = fp_add([(shp, dt, lid) for _, shp, dt, lid in outs], True)
            lay = layout(tuple([(s, shp, dt, dev) for s, shp, dt, _ in ins]
                               + [(s, shp, dt, dev) for s, shp, dt, _ in outs]))
            add((S_SPAN, step, index, parent, pid, call, t0 - t_step, t1 - t0, lay, fp_pre, fp_post,
                 len(ins), 0))
            if t1 >= self.next_flush:
                self.maybe_flush(t1)

        span(root, -1, t_step)  # the root's call begins with the step (same clock reading)
        t_end = nxt()
        add((schema.STEP_END, step, t_end, count[0], count[1]))
        # FINGERPRINTS records as StepFingerprints.collect writes them (_FpModel.plan).
        if first and self.pending_params is not None:
            for first_i, idx, packed in self.pending_params:
                add((schema.FINGERPRINTS, schema.PARAMS_STEP, first_i, self.pfp[idx, rank, :].tobytes(), packed))
                self.fp_records += 1
            self.pending_params = None
        plan = self.step_meta.get("plan")
        if plan is None:
            plan = self.step_meta["plan"] = [(first_i, np.asarray(lids, dtype=np.intp), packed)
                                             for first_i, lids, packed in fp.plan()]
        for first_i, lids, packed in plan:
            add((schema.FINGERPRINTS, step, first_i, V32[lids, rank, :].tobytes(), packed))
        self.fp_records += len(plan)
        self.stats["steps"] += 1
        self.stats["spans"] += count[0]
        self.stats["collectives"] += count[1]
        self.maybe_flush(t_end)
        return count

    def close(self):
        self.w.flush()  # Tracer.stop: the END record in a chunk of its own
        self.stats["bytes"] = self.w.bytes_written
        self.stats["stale_fingerprints"] = 0
        self.w.add((schema.END, dict(reason="exit", stats=dict(self.stats))))
        self.w.close()


# ---------------------------------------------------------------------------- timeline


def _event_durations(root: Node) -> list:
    """Reference host time (µs) elapsed before each event of a step, in event order: step
    begin (= the root's call), span begin/end and collective begin/end (depth first), step end."""
    out = []

    def span(node):
        out.append(8.0 if out else 0.0)  # pre-hook
        for item in node.body:
            if isinstance(item, Node):
                span(item)
            elif isinstance(item, Coll):
                out.append(4.0)
                out.append(item.dur_us)
            else:
                out.append(("c", item))  # the module's own code: folded into the next event
        out.append(8.0)  # post-hook

    span(root)
    out.append(10.0)
    # fold module compute time into the next event
    res, carry = [], 0.0
    for x in out:
        if isinstance(x, tuple):
            carry += x[1]
        else:
            res.append(x + carry)
            carry = 0.0
    return res


def generate(out_dir: str, steps: int, ranks: int = 8, seed: int = 0, spread: str = "realistic",
             shape: Shape | None = None, replace: bool = True, log=None) -> dict:
    """Write DIR/run.json and DIR/ranks/HOST-PID.ttr for ``ranks`` ranks and ``steps`` steps."""
    shape = shape or Shape()
    shape.check(ranks)
    if os.path.exists(out_dir):
        if not replace:
            raise SystemExit(f"{out_dir} exists")
        shutil.rmtree(out_dir)
    os.makedirs(os.path.join(out_dir, "ranks"))
    t_start = time.perf_counter()
    root, V, params = build(shape, ranks, spread)
    pfp = param_fingerprints(params, ranks, seed + 99991)
    run_id = random.Random(seed).getrandbits(64).to_bytes(8, "big").hex()
    host = socket.gethostname()
    argv = ["-m", "sglang.launch_server", "--model-path", "deepseek-like-61L", "--tp-size", str(ranks)]
    config = dict(modules=[], exclude=[], steps=[0, None], fingerprint=True, otlp_endpoint=None,
                  flush_interval_s=1.0, max_errors=20, max_spans_per_step=1_000_000)
    wall0 = time.time_ns()
    with open(os.path.join(out_dir, "run.json"), "w") as f:
        json.dump(dict(run_id=run_id, argv=["python3", *argv], started_wall_ns=wall0, config=config), f, indent=1)
    mono0 = time.monotonic_ns()
    rng = random.Random(seed)
    base_pid = 40000 + rng.randrange(20000)
    sims = []
    for r in range(ranks):
        start = mono0 + 4_000_000_000 + r * 3_000_000 + rng.randrange(1_000_000)
        sim = _Rank(out_dir, run_id, r, ranks, host, base_pid + 7 * r + 3, start,
                    wall0 + (start - mono0), argv)
        sim.all_ranks = list(range(ranks))
        sim.params(params, pfp)
        sims.append(sim)
    base_us = np.asarray(_event_durations(root))
    t_ref = mono0 + 30_000_000_000  # the first step, 30 s after the launch (model loading)
    trng = np.random.default_rng(seed + 7)
    n_spans = n_colls = 0
    for step in range(steps):
        V32 = V.draw(seed * 1_000_003 + step)
        jitter = trng.lognormal(0.0, 0.25, size=len(base_us))
        ref = np.cumsum(base_us * jitter * 1000.0)  # ns from the step's start
        for sim in sims:
            a = 1.0 + trng.uniform(-2e-3, 2e-3)
            b = int(trng.uniform(0, 20_000))
            times = (t_ref + b + (ref * a)).astype(np.int64).tolist()
            ns, nc = sim.run_step(step, root, V32, times)
            n_spans += ns
            n_colls += nc
        t_ref += int(ref[-1]) + int(trng.uniform(2e6, 4e6))
        if log and (step + 1) % 50 == 0:
            log(f"  generated step {step + 1}/{steps} ({time.perf_counter() - t_start:.1f} s)")
    for sim in sims:
        sim.close()
    files = [s.path for s in sims]
    return dict(dir=out_dir, run_id=run_id, steps=steps, ranks=ranks, spans=n_spans, collectives=n_colls,
                span_records=n_spans + n_colls, fingerprint_records=sum(s.fp_records for s in sims),
                files=len(files),
                bytes=sum(os.path.getsize(p) for p in files), seconds=time.perf_counter() - t_start,
                spread=spread)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="trace folder to (re)create")
    p.add_argument("--steps", type=int, default=None, help="default: ~2 million span records in all")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp-spread", choices=["realistic", "wide"], default="realistic")
    p.add_argument("--info-json", metavar="PATH", help="write the summary here (else print it)")
    a = p.parse_args(argv)
    steps = a.steps or steps_for(2_000_000, a.ranks)
    info = generate(a.out, steps, a.ranks, a.seed, a.fp_spread, log=lambda m: print(m, flush=True))
    if a.info_json:
        with open(a.info_json, "w") as f:
            json.dump(info, f)
    else:
        print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
