"""Small synthetic traces for the verdict engine's unit tests.

A test declares what a TP group did (ranks and their identity, module calls with their tensors
per rank, parameters, collectives, framework layer attributes) and ``SyntheticTrace.merge``
writes one rank file per readable rank with the real ``RankWriter``, record for record as the
tracer writes them (span indices in call order, fingerprint indices in the order the tracer takes
them: a call's inputs when it begins, its outputs when it ends), then merges them with the real
merge and opens the store for ``tensor_trace.exporters.query``.

``point``/``check``/``items``/``names_*`` read a verdict back (placement, reduction, rule and
the evidence items' references) through ``query placement`` and ``query reduction``.

Values are given as numpy arrays per rank (``arrays``/``same``: shape, dtype and the fingerprint
are computed from them, so sums that should add up really do) or as explicit fingerprints
(``fps``). A rank missing from a tensor's values gets no slot for it (a module that returns
None there, a gather's output on the ranks it does not deliver to).

Two fields the current record format cannot carry are written only when the store has a column
for them (``store_has``): a collective's ``attrs`` (a dict after the COLLECTIVE record's
``bytes``) and a parameter's ``meta`` (a dict after each PARAMS entry's fingerprint index). A
tensor's own meta (a DTensor activation's placements) cannot be expressed by
``RankWriter.layout`` at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import struct

import numpy as np

from tensor_trace import schema
from tensor_trace.exporters import pipeline as mg
from tensor_trace.exporters import query
from tensor_trace.exporters.store.tables import SCHEMA_SQL
from tensor_trace.format.fingerprints import nonfinite_record_values, pack_host_values, wide_record_values
from tensor_trace.tracer.writer import RankWriter

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}


def store_has(table: str, column: str) -> bool:
    """Whether the merged store of this checkout has ``table.column``."""
    con = sqlite3.connect(":memory:")
    con.executescript(SCHEMA_SQL)
    cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
    con.close()
    return column in cols


def bf16(a) -> np.ndarray:
    """``a`` rounded to bfloat16 (round to nearest even), as float32."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def fingerprint(a, dtype="float32") -> tuple:
    """(sum, sum of squares) of ``a`` as the tracer takes them: in fp32 from the dtype's values."""
    a = np.asarray(a, dtype=np.float32)
    if dtype == "bfloat16":
        a = bf16(a)
    elif dtype == "float16":
        a = a.astype(np.float16).astype(np.float32)
    a64 = a.astype(np.float64)
    if not np.isfinite(a64).all():  # and the NONFINITE_FINGERPRINTS entry the tracer writes for it
        f = a64[np.isfinite(a64)]
        return (float(a64.sum()), float((a64 * a64).sum()),
                (float(f.sum()), float((f * f).sum()), int(np.isposinf(a64).sum()), int(np.isneginf(a64).sum()),
                 int(np.isnan(a64).sum())))
    return float(a64.sum()), float((a64 * a64).sum())


class Vals:
    """One logical tensor on every rank: rank -> (shape, dtype, fingerprint or None)."""

    def __init__(self, per_rank: dict):
        self.per_rank = per_rank

    def on(self, rank):
        return self.per_rank.get(rank)


def arrays(per_rank: dict, dtype="float32") -> Vals:
    """Values given as an array per rank."""
    return Vals({r: (tuple(np.shape(a)), dtype, fingerprint(a, dtype)) for r, a in per_rank.items()})


def same(a, ranks, dtype="float32") -> Vals:
    """The same array on every rank of ``ranks``."""
    return arrays({r: a for r in ranks}, dtype)


def fps(shape, per_rank: dict, dtype="float32") -> Vals:
    """Explicit fingerprints per rank (None: no fingerprint); ``shape`` may be a dict per rank."""
    return Vals({r: (tuple(shape[r] if isinstance(shape, dict) else shape), dtype, fp)
                 for r, fp in per_rank.items()})


def no_fp(shape, ranks, dtype="float32") -> Vals:
    return Vals({r: (tuple(shape), dtype, None) for r in ranks})


class _Call:
    def __init__(self):
        self.outputs = None

    def returns(self, *outputs: Vals) -> None:
        self.outputs = list(outputs)


class SyntheticTrace:
    """What one TP group did, to be written as rank files and merged."""

    def __init__(self, world_size=2, *, readable=None, tp_ranks=None, root="model", identity=None):
        self.world_size = world_size
        self.identity = identity or {}  # rank -> more identity (e.g. a framework's "groups")
        self.readable = list(range(world_size)) if readable is None else list(readable)
        self.tp_ranks = tp_ranks
        self.root = root
        self.params: list = []  # (module, name, Vals, meta)
        self.layer_attrs: dict = {}
        self.groups = {"tp": (0, list(tp_ranks or range(world_size)))}
        self.steps: list = []  # [(attrs, events, end attrs)]
        self._events = None

    # -- declaring ------------------------------------------------------------------------
    def param(self, module, name, values: Vals, meta=None) -> None:
        self.params.append((module, name, values, meta))

    def group(self, name, ranks_of: dict) -> None:
        """A group of another set of ranks on each rank (rank -> the ranks of its group): a data-
        parallel group per tensor-parallel rank, say."""
        ids = {}
        for rank, ranks in ranks_of.items():
            ids.setdefault(tuple(ranks), 100 + len(self.groups) * 10 + len(ids))
        self.groups[name] = {rank: (ids[tuple(ranks)], list(ranks)) for rank, ranks in ranks_of.items()}

    def layer(self, module, attrs: dict) -> None:
        """What a framework says the layer does (a MODULE_ATTRS record)."""
        self.layer_attrs[module] = attrs

    @contextlib.contextmanager
    def step(self, attrs=None, per_rank=None, end_per_rank=None):
        """One step; ``per_rank`` (rank -> attrs) adds to ``attrs`` where ranks ran different
        batches (DP attention's token counts); ``end_per_rank`` (rank -> attrs) are written with
        the step's end (what a framework learnt during the step: ``Tracer.add_step_attrs``)."""
        self._events = []
        yield self
        self.steps.append(({"": attrs or {}, **(per_rank or {})}, self._events, end_per_rank or {}))
        self._events = None

    @contextlib.contextmanager
    def call(self, module, *inputs: Vals, cls="Module", no_fp=False):
        """A module call: its inputs when it begins; ``returns`` sets its outputs."""
        c = _Call()
        self._events.append(("begin", module, cls, list(inputs), no_fp))
        yield c
        self._events.append(("end", module, c.outputs or [], no_fp))

    def recorded_op(self, op="view") -> None:
        """A lineage record of an op that builds none of the points: the step's ops were
        watched (lineage is taken on a schedule), and the points were not built by them."""
        self._events.append(("op", op))

    def coll(self, op, inputs, outputs, *, reduce_op="sum", group="tp", attrs=None, flags=None) -> None:
        """A collective of ``group``; ``op`` a name, or a name per rank (a send paired with a
        recv); ``attrs`` is a dict, or a dict per rank; ``flags`` rank -> its record's flags
        (schema.FLAG_ERROR: it raised there), and a rank left out of a ``flags`` dict that has
        ``None`` for it never issued it."""
        self._events.append(("coll", op, reduce_op, group, list(inputs), list(outputs), attrs, flags))

    # -- writing ----------------------------------------------------------------------------
    def write(self, trace_dir: str) -> None:
        os.makedirs(os.path.join(trace_dir, "ranks"), exist_ok=True)
        with open(os.path.join(trace_dir, "run.json"), "w") as f:
            json.dump(dict(run_id="synthetic"), f)
        for rank in self.readable:
            self._write_rank(trace_dir, rank)

    def merge(self, trace_dir) -> sqlite3.Connection:
        """Write, merge with the real merge, and open the store read-only."""
        trace_dir = str(trace_dir)
        self.write(trace_dir)
        mg.merge_ranks(trace_dir, warn=lambda msg: None)
        return mg.open_store(trace_dir)

    def _write_rank(self, trace_dir, rank) -> None:
        w = RankWriter(os.path.join(trace_dir, "ranks", f"host-{rank}{schema.RANK_FILE_SUFFIX}"),
                       dict(run_id="synthetic", pid=1000 + rank, host="host", mono_ns=0, wall_ns=0),
                       flush_interval_s=3600)
        ident = dict(rank=rank, world_size=self.world_size, local_rank=rank, device="cpu")
        if self.tp_ranks is not None:
            ident.update(tp_ranks=list(self.tp_ranks), tp_size=len(self.tp_ranks))
        ident.update(self.identity.get(rank, {}))
        w.add((schema.IDENTITY, ident))
        for module, attrs in self.layer_attrs.items():
            w.add((schema.MODULE_ATTRS, w.module(module, attrs.get("sglang_class", "Module")), attrs))
        self._write_params(w, rank)
        coll_attrs = store_has("collectives", "attrs")
        seq = {g: 0 for g in self.groups}
        written_groups = set()
        for step, (attrs_of, events, end_of) in enumerate(self.steps):
            step_attrs = dict(attrs_of[""], **attrs_of.get(rank, {}))
            fp_rec: dict = {}  # index -> (sum, sumsq)
            counter = [0]

            def reserve(vals: list, no_fp=False):
                tensors = [t for t in (v.on(rank) for v in vals) if t is not None]  # (absent here: no slot)
                if no_fp or not tensors or all(t[2] is None for t in tensors):
                    return -1
                first = counter[0]
                for i, t in enumerate(tensors):
                    if t[2] is not None:
                        fp_rec[first + i] = t[2]
                counter[0] += len(tensors)
                return first

            base = 1_000_000 * (step + 1)
            w.add((schema.STEP_BEGIN, step, w.module(self.root, "Root"), base, step_attrs))
            t = 0
            stack = [[0, -1, 0, []]]  # [span index, fp_pre, t0, inputs] of the open calls; 0 = root
            calls: dict = {}
            n_spans, n_colls = 1, 0
            for ev in events:
                t += 10
                if ev[0] == "begin":
                    _, module, cls, inputs, no_fp = ev
                    w.module(module, cls)
                    stack.append([n_spans, reserve(inputs, no_fp), t, inputs, stack[-1][0]])
                    n_spans += 1
                elif ev[0] == "end":
                    _, module, outputs, no_fp = ev
                    idx, fp_pre, t0, inputs, parent = stack.pop()
                    fp_post = reserve(outputs, no_fp)
                    out_names = ["output"] if len(outputs) == 1 else [f"output.{i}" for i in range(len(outputs))]
                    slots = [(f"input.{i}", v.on(rank)) for i, v in enumerate(inputs)]
                    slots += list(zip(out_names, (v.on(rank) for v in outputs)))
                    slots = [(s, x) for s, x in slots if x is not None]
                    lay = w.layout(tuple((s, tuple(x[0]), x[1], "cpu") for s, x in slots))
                    call = calls.get(module, -1) + 1
                    calls[module] = call
                    w.add((schema.SPAN, step, idx, parent, w.string(module), call, t0, t - t0, lay,
                           fp_pre, fp_post, len(inputs), 0))
                elif ev[0] == "op":
                    w.add((schema.LINEAGE, step, 1000 + n_spans, w.string(ev[1]), None, [], None))
                else:
                    _, op, redop, group, inputs, outputs, attrs, flags = ev
                    if flags is not None and rank in flags and flags[rank] is None:
                        continue  # (this rank never issued it)
                    gid, granks = self.groups[group] if isinstance(self.groups[group], tuple) else \
                        self.groups[group][rank]
                    if group not in written_groups:
                        w.add((schema.GROUP, gid, group, granks, "gloo", str(gid)))
                        written_groups.add(group)
                    fp_pre = reserve(inputs)
                    fp_post = reserve(outputs)
                    slots = [(f"input.{i}", v.on(rank)) for i, v in enumerate(inputs)]
                    slots += [(f"output.{i}", v.on(rank)) for i, v in enumerate(outputs)]
                    slots = [(s, x) for s, x in slots if x is not None]
                    lay = w.layout(tuple((s, tuple(x[0]), x[1], "cpu") for s, x in slots))
                    nbytes = sum(math.prod(v.on(rank)[0]) * _ITEMSIZE.get(v.on(rank)[1], 4) for v in inputs
                                 if v.on(rank) is not None)
                    rec = [schema.COLLECTIVE, step, n_colls, stack[-1][0],
                           w.string(op if isinstance(op, str) else op[rank]),
                           w.string(redop) if redop else -1, gid, seq[group], t, 5, lay, fp_pre, fp_post,
                           len(inputs), (flags or {}).get(rank) or 0, nbytes]
                    if coll_attrs and attrs is not None:
                        rec.append(attrs.get(rank) if isinstance(attrs, dict) and rank in attrs else attrs)
                    w.add(tuple(rec))
                    seq[group] += 1
                    n_colls += 1
                    t += 5
            assert len(stack) == 1, "a call was left open"
            t += 10
            w.add((schema.SPAN, step, 0, -1, w.string(self.root), 0, 0, t, w.layout(()), -1, -1, 0, 0))
            if end_of.get(rank):
                w.add((schema.STEP_END, step, base + t, n_spans, n_colls, end_of[rank]))
            else:
                w.add((schema.STEP_END, step, base + t, n_spans, n_colls))
            if fp_rec:
                for rec in _fingerprints(step, fp_rec):
                    w.add(rec)
        w.add((schema.END, dict(reason="exit", stats={})))
        w.close()

    def _write_params(self, w, rank) -> None:
        with_meta = store_has("params", "meta")
        by_module: dict = {}
        for module, name, vals, meta in self.params:
            if vals.on(rank) is not None:
                by_module.setdefault(module, []).append((name, vals.on(rank), meta))
        fp_rec = {}
        index = 0
        for module, entries in by_module.items():
            rows = []
            for name, (shape, dtype, fp), meta in entries:
                row = [w.string(name), w.meta(tuple(shape), dtype, "cpu"), index]
                if with_meta and meta is not None:
                    row.append(meta)
                rows.append(row)
                if fp is not None:
                    fp_rec[index] = fp
                index += 1
            w.add((schema.PARAMS, w.module(module, "Linear"), rows))
        if fp_rec:
            for rec in _fingerprints(schema.PARAMS_STEP, fp_rec):
                w.add(rec)


def _fingerprints(step, fp_rec: dict) -> list:
    """The FINGERPRINTS record of a step's values, and a WIDE_FINGERPRINTS one for values past
    float32's range, as the tracer writes them."""
    idx = sorted(fp_rec)
    data, wide = pack_host_values([v for i in idx for v in fp_rec[i][:2]])
    contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
    out = [(schema.FINGERPRINTS, step, idx[0], data, None if contiguous else struct.pack(f"<{len(idx)}I", *idx))]
    if wide:
        out.append((schema.WIDE_FINGERPRINTS, step, wide_record_values((idx[k], s, q) for k, s, q in wide)))
    nonfinite = [(i, *fp_rec[i][2]) for i in idx if len(fp_rec[i]) > 2]
    if nonfinite:
        out.append((schema.NONFINITE_FINGERPRINTS, step, nonfinite_record_values(nonfinite)))
    return out


# ---------------------------------------------------------------------- reading verdicts back
def gen(seed=0):
    """A seeded generator."""
    return np.random.default_rng(seed)


def pos(rng, *shape):
    """Positive values: sums far from zero, so a common scale is visible in them."""
    return rng.uniform(0.5, 1.5, shape).astype(np.float32)


def point(con, name):
    """The one point ``name`` as ``query placement`` reports it (checked against ``query reduction``)."""
    (p,) = query.placement(con, name)
    red = query.reduction(con, name)
    # The two queries tell the same story.
    assert (red["verdict"], red["placement"], red["rule"]) == (p["reduction"], p["placement"], p["rule"])
    return p


def check(p, placement, reduction, rule):
    """The verdict and the rule that decided it."""
    assert (p["placement"], p["reduction"], p["rule"]) == (placement, reduction, rule), p["evidence"]


def items(p, kind):
    """The evidence items of one kind."""
    return [i for i in p["evidence_items"] if i["kind"] == kind]


def names_collective(p, op, seq=None):
    """An evidence item points at collective ``op`` (#``seq``)."""
    refs = [i["refs"].get("collective") for i in items(p, "collective")]
    assert any(r and r["op"] == op and (seq is None or r["seq"] == seq) for r in refs), p["evidence"]
    if p["collective"] is not None:
        assert p["collective"]["op"] == op


def names_param(p, param):
    """A weights item points at parameter ``param``."""
    assert any(i["refs"].get("param") == param for i in items(p, "weights")), p["evidence"]


def names_point(p, kind, name):
    """An item of ``kind`` points at point ``name``."""
    assert any(i["refs"].get("point") == name for i in items(p, kind)), p["evidence"]
