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

from synth_model import BF16, I64, Coll, Node, Shape, build, param_fingerprints, steps_for  # noqa: F401

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
        # Format 2 (tracer/fingerprint_records.py, step_records): every value of the step, repeats
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

    def capture_step(self, step, root, V32, times) -> list:
        """``run_step``, also returning the step's records (a template for ``repeat_step``)."""
        records = []
        write = self.w.add

        def add(rec):
            records.append(rec)
            write(rec)

        self.w.add = add  # run_step binds w.add when it starts
        try:
            self.run_step(step, root, V32, times)
        finally:
            del self.w.add
        kinds = {rec[0] for rec in records}
        if not kinds <= self.REPEATABLE:
            raise ValueError(f"step {step} defines ids (record kinds {sorted(kinds - self.REPEATABLE)}): "
                             "only a step after the first can be repeated")
        return records

    # What a step after the first holds: every id it uses was defined in the first.
    REPEATABLE = frozenset((schema.STEP_BEGIN, schema.SPAN, schema.COLLECTIVE, schema.STEP_END,
                            schema.FINGERPRINTS))

    def repeat_step(self, step, template: list, t_step: int) -> tuple:
        """Write a captured step again as step ``step`` beginning at ``t_step``: the same records
        (span times are offsets from the step's start) with the new step number, the step's
        clock readings moved, and the group's next sequence numbers: what the tracer writes for
        a step identical to the template. Returns (spans, collectives, the step's duration)."""
        add = self.w.add
        S_SPAN, S_COLL, S_BEGIN, S_END = schema.SPAN, schema.COLLECTIVE, schema.STEP_BEGIN, schema.STEP_END
        t_begin = template[0][3]
        spans = colls = 0
        for rec in template:
            kind = rec[0]
            if kind == S_SPAN:
                add((kind, step, *rec[2:]))
                spans += 1
            elif kind == S_COLL:
                add((kind, step, *rec[2:7], self.seq, *rec[8:]))
                self.seq += 1
                colls += 1
            elif kind == S_BEGIN:
                add((kind, step, rec[2], t_step, *rec[4:]))
            elif kind == S_END:
                t_end = t_step + rec[2] - t_begin
                add((kind, step, t_end, *rec[3:]))
            else:
                add((kind, step, *rec[2:]))
        self.stats["steps"] += 1
        self.stats["spans"] += spans
        self.stats["collectives"] += colls
        self.fp_records += sum(1 for rec in template if rec[0] == schema.FINGERPRINTS)
        self.maybe_flush(t_end)
        return spans, colls, t_end - t_step

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
             shape: Shape | None = None, replace: bool = True, log=None, repeat_after: int | None = None) -> dict:
    """Write DIR/run.json and DIR/ranks/HOST-PID.ttr for ``ranks`` ranks and ``steps`` steps.

    ``repeat_after`` K (at least 2): steps 0 .. K-1 are simulated; every later step repeats one
    of steps 1 .. K-1 in turn (``_Rank.repeat_step``: new step number, clock and sequence
    numbers, the template's values), several times faster: how large traces are made."""
    if repeat_after is not None and not 2 <= repeat_after:
        raise SystemExit("--repeat-after must be at least 2 (step 0 defines the ids)")
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
    templates = {sim.rank: [] for sim in sims}
    for step in range(steps):
        if repeat_after is not None and step >= repeat_after:
            k = (step - repeat_after) % (repeat_after - 1)
            duration = 0
            for sim in sims:
                tmpl = templates[sim.rank][k]
                ns, nc, dur = sim.repeat_step(step, tmpl, t_ref + int(trng.uniform(0, 20_000)))
                duration = max(duration, dur)
                n_spans += ns
                n_colls += nc
            t_ref += duration + int(trng.uniform(2e6, 4e6))
            if log and (step + 1) % 500 == 0:
                log(f"  generated step {step + 1}/{steps} ({time.perf_counter() - t_start:.1f} s)")
            continue
        V32 = V.draw(seed * 1_000_003 + step)
        jitter = trng.lognormal(0.0, 0.25, size=len(base_us))
        ref = np.cumsum(base_us * jitter * 1000.0)  # ns from the step's start
        for sim in sims:
            a = 1.0 + trng.uniform(-2e-3, 2e-3)
            b = int(trng.uniform(0, 20_000))
            times = (t_ref + b + (ref * a)).astype(np.int64).tolist()
            if repeat_after is not None and step >= 1:
                templates[sim.rank].append(sim.capture_step(step, root, V32, times))
                ns = sum(1 for rec in templates[sim.rank][-1] if rec[0] == schema.SPAN)
                nc = sum(1 for rec in templates[sim.rank][-1] if rec[0] == schema.COLLECTIVE)
            else:
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
    p.add_argument("--repeat-after", type=int, default=None, metavar="K",
                   help="simulate steps 0..K-1 only; later steps repeat steps 1..K-1 in turn (fast: large traces)")
    p.add_argument("--info-json", metavar="PATH", help="write the summary here (else print it)")
    a = p.parse_args(argv)
    steps = a.steps or steps_for(2_000_000, a.ranks)
    info = generate(a.out, steps, a.ranks, a.seed, a.fp_spread, log=lambda m: print(m, flush=True),
                    repeat_after=a.repeat_after)
    if a.info_json:
        with open(a.info_json, "w") as f:
            json.dump(info, f)
    else:
        print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
