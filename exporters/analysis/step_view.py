"""One step of one TP group, aligned across its ranks: every point's tensor on every rank, every
collective with its inputs and outputs, and the order they happened in."""

from __future__ import annotations

import bisect
import collections
import json

from tensor_trace.exporters.analysis.tolerance import Observed, all_equal
from tensor_trace.format.fingerprints import F32_MAX, decode_fingerprints

REDUCING = {"all_reduce", "all_reduce_", "all_reduce_coalesced", "reduce", "reduce_scatter",
            "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
            "reduce_scatter_tensor_coalesced"}
REDUCE_SCATTER = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                  "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"}
GATHER = {"all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
          "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "gather"}
# Each rank sends a piece of its input to every rank and receives theirs: neither a reduction
# nor a gather (an expert-parallel layer's token dispatch and combine).
EXCHANGE = {"all_to_all", "all_to_all_single"}
BROADCAST = {"broadcast"}
SUM_OPS = {None, "sum", "avg", "redopType.sum", "SUM", "AVG"}
# How far from a point to look for the collective that consumes or produced it: a partial sum
# is reduced, and a shard gathered, within the next few collectives of its rank.
WINDOW = 16


class Collective:
    """One collective of the step, matched across ranks by (group, sequence number)."""

    __slots__ = ("key", "op", "reduce_op", "group", "seq", "module", "span", "t_end", "t0", "ins", "outs",
                 "bytes", "group_name", "group_ranks", "attrs", "attrs_of", "groups_of")

    @property
    def sums(self) -> bool:
        return self.op in REDUCING and self.reduce_op in SUM_OPS


def _family_keys(pairs, ranks_of, rank_of, my_ranks) -> dict:
    """(proc, group id) -> the key of a group that does not hold every rank judged, of the
    (proc, group id) ``pairs`` the step's collectives ran in (``ranks_of``: group id -> its
    ranks), as its ranks relative to its first: a family of groups alike up to a shift, one per rank judged or
    partitioning them (data-parallel groups [0, 2] and [1, 3] of TP ranks 0 and 1, both (0, 2);
    TP groups [0, 1] and [2, 3] of a world judged whole, both (0, 1)). Each rank issues its own
    group's collectives in the same order, so matched by their sequence they are one collective,
    as for a group of them all. Where two groups of one process are alike (a TP and an expert
    group of the same ranks), neither is keyed so: their sequences could not be told apart."""
    by_proc: dict = {}
    for proc, gid in pairs:
        ranks = ranks_of[gid]
        rank = rank_of.get(proc)
        if rank is None or len(my_ranks) < 2 or rank not in ranks or my_ranks <= set(ranks):
            continue
        by_proc.setdefault(proc, {})[gid] = ("family",) + tuple(r - min(ranks) for r in sorted(ranks))
    keys = {}
    for proc, groups in by_proc.items():
        shapes = collections.Counter(groups.values())
        keys.update({(proc, gid): key for gid, key in groups.items() if shapes[key] == 1})
    return keys


def _collective_attrs_column(con) -> bool:
    return any(r[1] == "attrs" for r in con.execute("PRAGMA table_info(collectives)"))


def _slot_meta(slot) -> dict | None:
    return slot[4] if len(slot) > 4 and isinstance(slot[4], dict) else None


def _is_wide(o) -> bool:
    return o.fp is not None and (abs(o.fp[0]) > F32_MAX or (o.fp[1] is not None and o.fp[1] > F32_MAX))


def _wide_only_where_equal(obs: dict) -> None:
    """Values past float32's range (WIDE_FINGERPRINTS) are a real tensor's only as sentinels,
    the same on every rank (an attention mask of finfo.min); else they are uninitialised
    memory (a buffer before its broadcast, gathered padding), which says nothing: such a
    tensor is taken as non-finite, as its float32 sums were, unless every rank's read equal."""
    if not any(map(_is_wide, obs.values())):
        return
    ts = list(obs.values())
    if len({o.shape for o in ts}) == 1 and all(o.fp is not None for o in ts) and all_equal(ts):
        return  # (equal as any values are: two ways of summing may differ in the last bits)
    for o in obs.values():
        if _is_wide(o):
            o.fp, o.nonfinite = None, True


class StepView:
    """Everything one TP group did in one step, aligned across its ranks."""

    def __init__(self, con, step, procs, layouts, modules, rank_of):
        self.step = step
        self.procs = procs
        fps = {p: {} for p in procs}
        for proc, first, data, indices in con.execute(
                "SELECT proc, first, data, indices FROM fingerprints WHERE step=?", (step,)):
            if proc not in fps:
                continue
            decode_fingerprints(first, data, indices, fps[proc])
        wide = False
        for proc, idx, s, q in con.execute(  # values past float32's range, over their +-inf
                "SELECT proc, idx, sum, sumsq FROM wide_fingerprints WHERE step=?", (step,)):
            if proc in fps:
                fps[proc][idx] = (s, q)
                wide = True
        nonfinite = {p: {} for p in procs}  # proc -> fingerprint index -> NONFINITE_FINGERPRINTS entry
        for proc, idx, *entry in con.execute(
                "SELECT proc, idx, sum, sumsq, posinf, neginf, nan FROM nonfinite_fingerprints WHERE step=?", (step,)):
            if proc in nonfinite:
                nonfinite[proc][idx] = tuple(entry)
        self.points: dict = {}  # (module, call, slot) -> {proc: Observed}
        self.times: dict = {}  # point key -> (ns from step start, span idx, slot idx) on the first proc
        self.span_of: dict = {}  # (proc, idx) -> (module, call, parent)
        self.span_t0: dict = {}  # span idx -> its start (ns from the step's start) on the first proc
        self.slot_key: dict = {}  # (proc, span idx, slot idx) -> point key
        self.max_call = collections.Counter()
        ph = ",".join("?" * len(procs))
        rows = []
        self.step_attrs: dict = {}  # proc -> the step's attrs as recorded (mode, tokens, ...)
        for proc, first, last, attrs in con.execute(
                f"SELECT proc, span_first, span_last, attrs FROM steps WHERE step=? AND proc IN ({ph})",
                (step, *procs)):
            self.step_attrs[proc] = json.loads(attrs) if attrs else {}
            if first is not None:
                rows += con.execute(
                    "SELECT proc, idx, parent, module_id, call, t0, dur, layout_id, fp_pre, fp_post, n_pre "
                    "FROM spans WHERE rowid BETWEEN ? AND ? AND step=?", (first, last, step)).fetchall()
        rows.sort(key=lambda r: procs.index(r[0]))
        for proc, idx, parent, mid, call, t0, dur, lay, fp_pre, fp_post, n_pre in rows:
            module = modules[mid]
            self.span_of[(proc, idx)] = (module, call, parent)
            if proc == procs[0]:
                self.span_t0[idx] = t0
            self.max_call[module] = max(self.max_call[module], call)
            d = fps[proc]
            for i, slot in enumerate(layouts.get(lay, ())):
                ref = (fp_pre + i if fp_pre >= 0 else -1) if i < n_pre else (
                    fp_post + i - n_pre if fp_post >= 0 else -1)
                key = (module, call, slot[0])
                self.slot_key[(proc, idx, i)] = key
                o = self.points.setdefault(key, {})[proc] = Observed(slot[1], slot[2], d.get(ref), _slot_meta(slot))
                if o.nonfinite:
                    o.nf = nonfinite[proc].get(ref)
                if proc == procs[0]:
                    self.times[key] = (t0 if i < n_pre else t0 + dur, idx, i)
        self.colls: dict = {}  # (group, seq) -> Collective with per-proc ins/outs
        my_ranks = {rank_of.get(p) for p in procs}
        attrs_col = "c.attrs" if _collective_attrs_column(con) else "NULL"
        coll_rows = con.execute(
            f"SELECT c.proc, c.idx, c.parent, c.op, c.reduce_op, c.group_id, c.seq, c.t0, c.dur, "
            f"c.layout_id, c.fp_pre, c.fp_post, c.n_pre, c.bytes, g.name, g.ranks, {attrs_col} "
            f"FROM collectives c JOIN groups g USING(group_id) WHERE c.step=? AND c.proc IN ({ph})",
            (step, *procs)).fetchall()
        ranks_of = {gid: json.loads(granks) for _, _, _, _, _, gid, *_, granks, _ in coll_rows}
        family = _family_keys({(r[0], r[5]) for r in coll_rows}, ranks_of, rank_of, my_ranks)
        for (proc, idx, parent, op, redop, gid, seq, t0, dur, lay, fp_pre, fp_post, n_pre, nbytes,
             gname, granks, attrs) in coll_rows:
            group_ranks = ranks_of[gid]
            key = (gid, seq)
            shape = family.get((proc, gid))
            if shape is not None:  # one of a family of groups: matched as one collective
                key = (shape, seq)
            c = self.colls.get(key)
            if c is None:
                c = Collective()
                c.key, c.op, c.reduce_op, c.group, c.seq = key, op, redop, gid, seq
                c.ins, c.outs, c.bytes, c.t_end, c.t0, c.module, c.span = {}, {}, nbytes, None, None, None, None
                c.group_name, c.group_ranks = gname, group_ranks
                c.attrs, c.attrs_of, c.groups_of = {}, {}, {}
                self.colls[key] = c
            c.groups_of[proc] = group_ranks
            c.attrs_of[proc] = json.loads(attrs) if attrs else {}
            d = fps[proc]
            slots = layouts.get(lay, ())
            c.ins[proc] = [Observed(s[1], s[2], d.get(fp_pre + i) if fp_pre >= 0 else None, _slot_meta(s))
                           for i, s in enumerate(slots[:n_pre])]
            c.outs[proc] = [Observed(s[1], s[2], d.get(fp_post + i) if fp_post >= 0 else None, _slot_meta(s))
                            for i, s in enumerate(slots[n_pre:])]
            if proc == procs[0]:
                c.attrs = c.attrs_of[proc]
                c.t_end, c.t0 = t0 + dur, t0
                owner = self.span_of.get((proc, parent))
                c.module = owner[0] if owner else None
                c.span = parent if owner else None
        if wide:
            for obs in self.points.values():
                _wide_only_where_equal(obs)
            for c in self.colls.values():
                for side in (c.ins, c.outs):
                    for i in range(max(map(len, side.values()), default=0)):
                        _wide_only_where_equal({p: ts[i] for p, ts in side.items() if i < len(ts)})
        self._con = con
        self._lineage = None
        self._node_points = None
        self._by_span = None  # span -> the collectives it issued (issued_by)
        self.coll_list = sorted((c for c in self.colls.values() if c.t_end is not None),
                                key=lambda c: c.t_end)
        self.coll_ends = [c.t_end for c in self.coll_list]
        # by issue: an async collective's output (waited later) is already the values a
        # point can carry once the call that issued it has returned
        self.coll_issued = sorted(self.coll_list, key=lambda c: c.t0)
        self.coll_starts = [c.t0 for c in self.coll_issued]
        # Tensors of the first rank by element count, sorted by their sum: finding "a tensor
        # whose fingerprint is this sum" is a bisection, not a scan of the step.
        by_numel: dict = collections.defaultdict(list)
        for key, obs in self.points.items():
            t = obs.get(procs[0])
            if t is not None and t.fp is not None:
                by_numel[t.numel].append((t.fp[0], key, t))
        for c in self.coll_list:
            for t in c.outs.get(procs[0], []):
                if t.fp is not None:
                    by_numel[t.numel].append((t.fp[0], None, t))
        self.by_numel = {}
        for n, items in by_numel.items():
            items.sort(key=lambda x: x[0])
            self.by_numel[n] = ([x[0] for x in items], items)

    def lineage(self) -> tuple:
        """The first process's lineage records of this step: ({node: (op, attrs, inputs,
        shape)}, {(span, slot): ref}), shape the op's result's (None where not recorded); empty
        where the step did not watch."""
        if self._lineage is None:
            proc = self.procs[0]
            nodes = {n: (op, json.loads(a) if a else {}, json.loads(i), json.loads(sh) if sh else None)
                     for n, op, a, i, sh in self._con.execute(
                         "SELECT node, op, attrs, inputs, shape FROM lineage WHERE proc=? AND step=?",
                         (proc, self.step))}
            sources = {(span, slot): json.loads(ref) for span, slot, ref in self._con.execute(
                "SELECT span, slot, ref FROM slot_sources WHERE proc=? AND step=?", (proc, self.step))}
            self._lineage = (nodes, sources)
        return self._lineage

    def after(self, t_point, ops=None, limit=WINDOW):
        """Up to ``limit`` collectives (of ``ops``, if given) ending at or after ``t_point``,
        nearest first."""
        out = []
        for c in self.coll_list[bisect.bisect_left(self.coll_ends, t_point):]:
            if ops is None or c.op in ops:
                out.append(c)
                if len(out) >= limit:
                    break
        return out

    def node_points(self) -> dict:
        """{lineage node: keys of the points whose tensor is that node's result}, of the first
        process (a tensor the recorded ops built that a module then received or returned)."""
        if self._node_points is None:
            out: dict = {}
            proc = self.procs[0]
            for (span, slot), ref in self.lineage()[1].items():
                if ref and ref[0] == 1 and ref[1] == self.step:
                    key = self.slot_key.get((proc, span, slot))
                    if key is not None:
                        out.setdefault(ref[2], []).append(key)
            self._node_points = out
        return self._node_points

    def issued_by(self, span_idx) -> list:
        """The collectives module call ``span_idx`` of the first process issued itself (not
        through a module it called), in the order they were issued."""
        if self._by_span is None:  # (one pass for the step: asked once or more per point)
            self._by_span = {}
            for c in self.coll_issued:
                self._by_span.setdefault(c.span, []).append(c)
        return self._by_span.get(span_idx, [])

    def before(self, t_point, ops=None, limit=WINDOW):
        """Up to ``limit`` collectives (of ``ops``, if given) issued by ``t_point``, the latest
        issued first."""
        out = []
        for c in reversed(self.coll_issued[:bisect.bisect_right(self.coll_starts, t_point)]):
            if ops is None or c.op in ops:
                out.append(c)
                if len(out) >= limit:
                    break
        return out


def coll_desc(c: Collective) -> str:
    op = f"{c.op}({c.reduce_op})" if c.reduce_op else c.op
    groups = sorted({tuple(g) for g in (getattr(c, "groups_of", None) or {}).values()})
    if len(groups) > 1:  # a family of groups (_family_keys)
        return f"{op} #{c.seq} of groups {', '.join(str(list(g)) for g in groups)} (each rank's own, alike), " \
               f"issued by {c.module or '<root>'}"
    return f"{op} #{c.seq} of group {c.group_name} {c.group_ranks}, issued by {c.module or '<root>'}"


def coll_json(c: Collective, proc) -> dict:
    ts = c.ins.get(proc) or c.outs.get(proc) or []
    t = ts[0] if ts else None
    return dict(op=c.op, reduce_op=c.reduce_op, group=c.group_name, group_ranks=c.group_ranks, seq=c.seq,
                shape=list(t.shape) if t else None, dtype=t.dtype if t else None, bytes=c.bytes,
                module=c.module)


def next_sum_reduction(view, pt):
    """The first sum-reducing collective after point ``pt`` whose input on each of the point's
    ranks has the point's size: the reduction a partial sum would be owed to."""
    for c in view.after(pt.t_point, REDUCING):
        if c.sums and all(c.ins.get(p) and c.ins[p][0].numel == pt.tref.numel for p in pt.procs):
            return c
    return None
