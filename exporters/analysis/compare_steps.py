"""The two sides of a ``compare``: each trace's TP group, its points' placements and its
steps, read one step at a time; and how steps of two runs are paired (``compare.py``).

A step's structure (its module calls and tensor layouts, in order) is recognised by a
positional checksum SQLite computes over its spans, so the points of a structure already seen
(every decode step of one batch size) are not laid out again: only the fingerprints are read,
gathered by index.
"""

from __future__ import annotations

import bisect
import json
import struct
from itertools import chain

from tensor_trace.errors import BadInput, NoAnswer
from tensor_trace.exporters.analysis.compare_vector import StepColumns, read_columns
from tensor_trace.exporters.analysis.tolerance import eps
from tensor_trace.exporters.analysis.verdicts import tp_groups_with_size
from tensor_trace.format.fingerprints import FP_PAIR


class Side:
    """One trace as compare reads it: its first TP group, the placement of every point, and
    its steps with their kinds."""

    def __init__(self, con, label: str):
        self.con, self.label = con, label
        groups = tp_groups_with_size(con)
        if not groups:
            raise BadInput(f"trace {label} has no processes")
        rank_of = {p: (r if r is not None else 0) for p, r in con.execute("SELECT proc, rank FROM processes")}
        groups.sort(key=lambda g: min(rank_of[p] for p in g[0]))
        procs, self.size = groups[0]
        self.procs = sorted(procs, key=lambda p: rank_of[p])
        self.ranks = [rank_of[p] for p in self.procs]
        self.modules = dict(con.execute("SELECT module_id, path FROM modules"))
        # fingerprints past float32's range (a finfo.min attention mask), by step: the steps
        # holding any are read by the scalar path, these values over the +-inf of their blobs
        self.wide: dict = {}  # step -> {proc: {index: (sum, sumsq)}}
        for proc, step, idx, sm, sq in con.execute("SELECT proc, step, idx, sum, sumsq FROM wide_fingerprints"):
            self.wide.setdefault(step, {}).setdefault(proc, {})[idx] = (sm, sq)
        self.layouts = {}
        for lid, slots in con.execute("SELECT layout_id, slots FROM layouts"):
            self.layouts[lid] = tuple((s[0], tuple(s[1]), s[2]) for s in json.loads(slots))
        self.points = {}  # (module, call, slot) -> (name, placement, reduction, evidence items)
        for name, module, call, slot, placement, reduction, items in con.execute(
                "SELECT point, module, call, slot, placement, reduction, evidence_items FROM points"):
            self.points[(module, call, slot)] = (name, placement, reduction, items)
        ph = ",".join("?" * len(self.procs))
        rows = con.execute(
            f"SELECT step, attrs, MIN(COALESCE(fingerprinted, 0)) FROM steps WHERE proc IN ({ph}) "
            f"AND t_end IS NOT NULL AND span_first IS NOT NULL AND NOT interrupted "
            f"GROUP BY step HAVING COUNT(*) = ? ORDER BY step", (*self.procs, len(self.procs))).fetchall()
        self._plans: dict = {}  # a step's span structure -> Plan
        self._aligned: dict = {}  # the plans of a step's processes -> whether their points align
        self.steps = []  # (step, kind)
        self.attrs = {}
        self.fingerprinted = set()  # steps every process took fingerprints in
        for step, attrs, fingerprinted in rows:
            if fingerprinted:
                self.fingerprinted.add(step)
            a = json.loads(attrs or "{}")
            self.attrs[step] = a
            if a.get("captured"):
                continue  # recorded under CUDA-graph capture: no values
            self.steps.append((step, step_kind(a)))  # paired by pair_steps on common fields

    def placement(self, key) -> str:
        ent = self.points.get(key)
        return ent[1] if ent else "unknown"

    def plans_align(self, plans) -> bool:
        """Whether the plans of a step's processes have the same points in the same order
        (found once per combination of plans)."""
        combo = tuple(map(id, plans))
        aligned = self._aligned.get(combo)
        if aligned is None:
            first = plans[0]
            aligned = self._aligned[combo] = all(p is first or p.keys == first.keys for p in plans)
        return aligned

    def read_step(self, step: int, wanted=None, vector: bool = False) -> "StepData":
        """Every wanted point of one step on every process of the group; ``vector``: its
        values by columns as well (``compare_vector.StepColumns``)."""
        con = self.con
        plans, raw = [], []
        ranges = dict((p, (f, l)) for p, f, l in con.execute(
            "SELECT proc, span_first, span_last FROM steps WHERE step=?", (step,)))
        for proc in self.procs:
            rng = ranges.get(proc)
            if rng is None or rng[0] is None:
                rng = (1, 0)
            # The step's structure (modules, calls, layouts, in order) as a positional checksum
            # computed by SQLite: only a structure not seen before is read in full.
            got = con.execute(_STRUCTURE_SQL, (rng[0],) * 7 + (rng[1], step)).fetchone()
            summary, fp_sums = got[:4], got[4:]
            plan = self._plans.get(summary)
            if plan is None:
                full = con.execute(
                    "SELECT module_id, call, layout_id, n_pre, fp_pre, fp_post, t0, dur FROM spans "
                    "WHERE rowid BETWEEN ? AND ? AND step=?", (rng[0], rng[1], step)).fetchall()
                plan = self._plans[summary] = Plan(self, full, wanted)
            # The spans' fingerprint bases, by two positional checksums: those of a step seen
            # before (the same structure fingerprinted alike) resolve to the same indices.
            got = plan.refs.get(fp_sums)
            if got is None:
                bases = con.execute("SELECT fp_pre, fp_post FROM spans WHERE rowid BETWEEN ? AND ? "
                                    "AND step=?", (rng[0], rng[1], step)).fetchall()
                got = plan.refs[fp_sums] = plan.resolve(bases)
            rows = con.execute("SELECT first, data, indices FROM fingerprints WHERE step=? AND proc=?",
                               (step, proc)).fetchall()
            plans.append(plan)
            raw.append((rows, got))
        wide = self.wide.get(step)
        if wide:
            return StepData(self, step, plans, [_column(rows, refs, largest, wide.get(proc))
                                                for proc, (rows, (refs, largest)) in zip(self.procs, raw)])
        if vector:
            by_proc = [read_columns(rows, refs, largest, plan.sources.setdefault(id(refs), {}))
                       for (rows, (refs, largest)), plan in zip(raw, plans)]
            if None not in by_proc:
                return StepData(self, step, plans, None, StepColumns(*map(list, zip(*by_proc))))
        return StepData(self, step, plans, [_column(rows, refs, largest) for rows, (refs, largest) in raw])


def _column(rows, refs: list, largest: int, wide: dict | None = None) -> list:
    """One process's values of a step in its plan's slot order: (sum, sumsq) or None; ``wide``:
    its values past float32's range, over those of ``rows``."""
    size = FP_PAIR.size
    vals: list = [None] * (largest + 2)
    top = len(vals) - 1  # the last entry stays None: where a slot without values points
    for first, data, indices in rows:
        n = len(data) // size
        flat = struct.unpack(f"<{2 * n}f", data[:n * size])
        pairs_ = zip(flat[0::2], flat[1::2])
        if indices is None:
            if first + n > top:
                vals[top:] = [None] * (first + n - top + 1)
                top = len(vals) - 1
            vals[first:first + n] = pairs_
        else:
            for i, v in zip(struct.unpack(f"<{n}I", indices[:4 * n]), pairs_):
                if i < top:
                    vals[i] = v
    for i, v in (wide or {}).items():
        if 0 <= i < top:
            vals[i] = v
    vals[-1] = None
    return list(map(vals.__getitem__, refs))


_STRUCTURE_SQL = ("SELECT COUNT(*), SUM(((rowid - ?) % 65536 * 65537 + module_id % 65536) * 8191 "
                  "+ call % 4096 * 31 + n_pre % 31), SUM(((rowid - ?) % 65536 + 1) * (layout_id % 1048576)), "
                  "SUM(call * 1000003 + layout_id), "
                  "SUM(((rowid - ?) % 65536 + 1) * (fp_pre + 2) + ((rowid - ?) % 65536 + 7) * (fp_post + 2)), "
                  "SUM(((rowid - ?) % 65536 + 1) * ((rowid - ?) % 65536 + 3) % 1000003 * (fp_pre * 3 + fp_post + 5)) "
                  "FROM spans WHERE rowid BETWEEN ? AND ? AND step=?")


class Plan:
    """The points of a step of one structure (the same module calls and tensor layouts, as
    every decode step of a batch size has): their keys, shapes, order, and per span which of
    its slots are read. Built once per structure; a step of that structure only reads values."""

    def __init__(self, side, rows, wanted):
        keys, meta, spec, times = [], [], [], []
        ends = sorted(r[6] + r[7] for r in rows)
        for module_id, call, lay, n_pre, _fp_pre, _fp_post, t0, dur in rows:
            module = side.modules[module_id]
            pre, post = [], []
            for i, (slot, shape, dtype) in enumerate(side.layouts.get(lay, ())):
                key = (module, call, slot)
                if wanted is not None and not wanted(key):
                    continue
                (pre if i < n_pre else post).append(i if i < n_pre else i - n_pre)
                keys.append(key)
                meta.append((shape, dtype))
                t = t0 if i < n_pre else t0 + dur
                times.append((t, bisect.bisect_right(ends, t)))
            spec.append((pre, post))
        self.keys, self.meta, self.spec, self.times = tuple(keys), meta, spec, times
        # The coarsest floating-point dtype of the step up to each point: values computed from
        # bfloat16 tensors carry bfloat16 rounding whatever their own dtype (the float32
        # logits of a bf16 matmul, and the step's outputs that carry them).
        self.coarsest = [None] * len(keys)
        worst, worst_eps = None, 0.0
        for i in sorted(range(len(keys)), key=lambda i: times[i]):
            dtype = meta[i][1]
            if str(dtype).startswith(("float", "bfloat")) and eps(dtype) > worst_eps:
                worst, worst_eps = dtype, eps(dtype)
            self.coarsest[i] = worst
        # per slot: (2 * span + 0 for an input, + 1 for an output, offset in its span's fingerprints)
        self.src = [(2 * j + side_, o) for j, (pre, post) in enumerate(spec)
                    for side_, offs in ((0, pre), (1, post)) for o in offs]
        self.index = {k: i for i, k in enumerate(keys)}
        self.refs: dict = {}  # the spans' fingerprint bases -> resolve(...)
        self.sources: dict = {}  # id of a resolve(...)'s refs -> compare_vector.read_columns' known

    def resolve(self, bases) -> list:
        """Each slot's fingerprint index (-1: none) from its span's (input, output) bases, and
        the largest index."""
        flat = list(chain.from_iterable(bases))
        refs = [flat[j] + o if flat[j] >= 0 else -1 for j, o in self.src]
        return refs, max(refs, default=0)


class StepData:
    """One step of one side: its plans and values per process."""

    def __init__(self, side, step, plans, cols, values=None):
        self.side, self.step, self.plans, self._cols = side, step, plans, cols
        self.values = values  # compare_vector.StepColumns, or None: ``cols`` only
        first = plans[0]
        self.aligned = side.plans_align(plans)
        self.plan = first
        if not self.aligned:  # processes of another structure: by key, slowly
            self.by_key = [dict(zip(p.keys, c)) for p, c in zip(plans, cols)]
            self.keys = list(dict.fromkeys(k for p in plans for k in p.keys))
        else:
            self.keys = first.keys

    @property
    def cols(self) -> list:
        """Per process, per slot of its plan: (sum, sumsq) or None."""
        if self._cols is None:
            self._cols = self.values.columns()
        return self._cols

    def per(self, key) -> list:
        """[(shape, dtype, fp) or None] per process of ``key``."""
        out = []
        for pi, (plan, col) in enumerate(zip(self.plans, self.cols)):
            i = plan.index.get(key)
            out.append(None if i is None else (plan.meta[i][0], plan.meta[i][1], col[i]))
        return out

    def order(self, key):
        for plan in self.plans:
            i = plan.index.get(key)
            if i is not None:
                return plan.times[i]
        return None


KIND_ATTRS = ("forward_mode", "tokens", "batch_size", "seq_lens_sum")


def step_kind(attrs: dict, fields=KIND_ATTRS):
    """What a step is, for pairing across runs: a server's forward mode, token count, batch
    size and total sequence length (so the k-th decode step of a request pairs with the k-th),
    or None for a program that records none of them (paired in order)."""
    kind = tuple(attrs.get(f) for f in fields)
    return None if all(v is None for v in kind) else kind


def parse_steps(specs) -> list:
    """``--steps`` values: ``A:B`` pairs step A of the first trace with step B of the second,
    ``N`` step N of both; several by commas or repeated options; ``A0-A1:B0`` a run of steps."""
    pairs = []
    for spec in specs or ():
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                a, _, b = part.partition(":")
                b = b or a
                if "-" in a:
                    lo, hi = (int(x) for x in a.split("-"))
                    b0 = int(b.split("-")[0])
                    pairs += [(s, b0 + s - lo) for s in range(lo, hi + 1)]
                else:
                    pairs.append((int(a), int(b)))
            except ValueError:
                raise BadInput(f"--steps {part!r}: expected A:B, N or A0-A1:B0 (step numbers)") from None
    return pairs


def pair_steps(a: Side, b: Side, explicit: list) -> tuple:
    """[(step_a, step_b)] and the steps left unpaired on each side."""
    if explicit:
        have_a, have_b = {s for s, _ in a.steps}, {s for s, _ in b.steps}
        for sa, sb in explicit:
            if sa not in have_a:
                raise BadInput(f"step {sa} is not a complete step of trace A (it has {_step_list(have_a)})")
            if sb not in have_b:
                raise BadInput(f"step {sb} is not a complete step of trace B (it has {_step_list(have_b)})")
        return list(explicit), [], []
    # Only what both traces recorded (a trace of an older tracer lacks some fields).
    fields = tuple(f for f in KIND_ATTRS if any(f in a.attrs[s] for s, _ in a.steps)
                   and any(f in b.attrs[s] for s, _ in b.steps))
    ka = [(s, step_kind(a.attrs[s], fields)) for s, _ in a.steps]
    kb = [(s, step_kind(b.attrs[s], fields)) for s, _ in b.steps]
    rids_a = {r for s, _ in ka for r in a.attrs[s].get("rids") or ()}
    if rids_a & {r for s, _ in kb for r in b.attrs[s].get("rids") or ()}:
        # the client named its requests: the same request ids are the same work
        ka = [(s, (k, tuple(a.attrs[s].get("rids") or ()))) for s, k in ka]
        kb = [(s, (k, tuple(b.attrs[s].get("rids") or ()))) for s, k in kb]
    queues: dict = {}
    for step, kind in kb:
        queues.setdefault(kind, []).append(step)
    pairs, left_a = [], []
    for step, kind in ka:
        q = queues.get(kind)
        if q:
            pairs.append((step, q.pop(0)))
        else:
            left_a.append(step)
    left_b = sorted(s for q in queues.values() for s in q)
    return pairs, left_a, left_b


def with_values(a: Side, b: Side, pairs: list) -> tuple:
    """(pairs whose steps took fingerprints in both runs, the other pairs): values are compared
    on the first only (``record --fingerprint-every`` fingerprints some steps); every pair, of
    either list, still has its structure, shapes and dtypes compared. Where neither run
    fingerprinted any step, every pair is in the first (its points are then not comparable,
    for want of values, as before schedules existed)."""
    if not a.fingerprinted and not b.fingerprinted:
        return list(pairs), []
    valued = [p for p in pairs if p[0] in a.fingerprinted and p[1] in b.fingerprinted]
    return valued, [p for p in pairs if p not in valued]


def _step_list(steps) -> str:
    s = sorted(steps)
    return ", ".join(map(str, s[:8])) + (" ..." if len(s) > 8 else "") if s else "none"
