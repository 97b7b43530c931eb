"""Placement and reduction verdicts for every capture point, from observed evidence only.

For each point (module path, call, tensor slot) the values seen on the ranks of its TP group in a
few sampled steps are compared. Evidence, strongest first:

1. Shapes across ranks: equal, or different along one dimension (an uneven shard).
2. Fingerprints (fp32 sum, sum of squares) across ranks: equal means replicate.
3. Collectives linked by fingerprint on every rank (identity, or one common scale factor, so a
   view, reshape, clone or scaling in between does not hide the link): the input of a
   sum-reduction means partial/pre-reduction; its output means post-reduction; the input of an
   all_gather, or the output of a reduce_scatter, means a shard.
4. A tensor elsewhere in the step whose shape is this one with dimension D times the group size
   and whose fingerprint is the sum of the ranks' fingerprints: its concatenation, so shard(D).
5. The module's own weights: equal shapes and different values across ranks (each rank holds a
   slice) make its differing output a shard; an input that is a shard or partial makes the
   differing outputs of parameter-free modules shards as well ("derived locally").
6. Otherwise, equal shapes with different values are ``divergent``: the ranks disagree.

Fingerprint comparisons tolerate rounding. Two sums of the same n values agree when
``|a - b| <= eps(dtype) * sqrt(sumsq) + 2**-20 * sqrt(n * sumsq)``: the first term covers
rounding each value once to the tensor's dtype (eps 2**-7 for bfloat16, 2**-10 for float16, 2**-20
for float32: several standard deviations of that rounding, whose errors add like a random walk),
the second covers fp32 accumulation in another order (1e-6 of the sum of absolute values at
most). Sums of squares agree within ``(4 * eps / sqrt(n) + 2**-18) * sumsq``. So a bf16 partial
sum on GPU still matches its reduced output, while two shards whose statistics differ by 1% do
not look replicate.
"""

from __future__ import annotations

import bisect
import collections
import json
import math

from tensor_trace import schema

EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -20, "float64": 2.0 ** -40}
REDUCING = {"all_reduce", "all_reduce_", "all_reduce_coalesced", "reduce", "reduce_scatter",
            "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
            "reduce_scatter_tensor_coalesced"}
REDUCE_SCATTER = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                  "_reduce_scatter_base", "reduce_scatter_tensor_coalesced"}
GATHER = {"all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
          "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced", "gather"}
SUM_OPS = {None, "sum", "avg", "redopType.sum"}
MAX_SAMPLE_STEPS = 3
# How far from a point to look for the collective that consumes or produced it: a partial sum
# is reduced, and a shard gathered, within the next few collectives of its rank.
WINDOW = 16


class T:
    """One tensor seen on one rank."""

    __slots__ = ("shape", "dtype", "fp", "numel")

    def __init__(self, shape, dtype, fp):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.fp = fp
        self.numel = math.prod(self.shape) if self.shape else 1


def _eps(dtype) -> float:
    return EPS.get(dtype, 2.0 ** -7)


def sum_tol(n: int, sq: float, dtype) -> float:
    sq = max(sq, 0.0)
    return _eps(dtype) * math.sqrt(sq) + 2.0 ** -20 * math.sqrt(max(n, 1) * sq) + 1e-30


def close(a: float, b: float, n: int, sq: float, dtype) -> bool:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= sum_tol(n, sq, dtype) + 1e-7 * (abs(a) + abs(b))


def fp_equal(x: T, y: T, scale: float = 1.0) -> bool:
    """``y`` holds ``scale`` times the values of ``x`` (same numel, same fingerprint)."""
    if x.fp is None or y.fp is None or x.numel != y.numel:
        return False
    (sx, qx), (sy, qy) = x.fp, y.fp
    if qx is None or qy is None:
        return False
    dtype = x.dtype if _eps(x.dtype) > _eps(y.dtype) else y.dtype
    qx2 = qx * scale * scale
    q = max(qx2, qy)
    q_tol = (4 * _eps(dtype) / math.sqrt(max(x.numel, 1)) + 2.0 ** -18) * q + 1e-30
    return abs(qx2 - qy) <= q_tol and close(sx * scale, sy, x.numel, q, dtype)


def linked(xs: dict, ys: dict) -> float | None:
    """The common scale c with ys[r] == c * xs[r] on every rank, or None."""
    procs = [p for p in xs if p in ys]
    if not procs or len(procs) < len(xs):
        return None
    ref = procs[0]
    x, y = xs[ref], ys[ref]
    if x.fp is None or y.fp is None or x.numel != y.numel or not x.fp[1] or y.fp[1] is None:
        return None
    if fp_equal(x, y):
        scale = 1.0
    else:
        # A common scale factor is believable only when the sums carry it: both far from zero
        # (the sum of squares alone fits any scale).
        tol = sum_tol(x.numel, max(x.fp[1], y.fp[1]), x.dtype)
        if min(abs(x.fp[0]), abs(y.fp[0] or 0.0)) < 64 * tol:
            return None
        scale = math.sqrt(y.fp[1] / x.fp[1])
        if x.fp[0] * y.fp[0] < 0:
            scale = -scale
        if abs(scale) < 1e-6 or not fp_equal(x, y, scale):
            return None
    for p in procs[1:]:
        if not fp_equal(xs[p], ys[p], scale):
            return None
    return scale


class _Coll:
    __slots__ = ("key", "op", "reduce_op", "group", "seq", "module", "t_end", "t0", "ins", "outs",
                 "bytes", "group_name", "group_ranks")


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
            d = fps[proc]
            for i, s, q in schema.fingerprint_pairs(first, data, indices):
                d[i] = (s, None if math.isnan(q) else q)
        self.points: dict = {}  # (module, call, slot) -> {proc: T}
        self.times: dict = {}  # point key -> time on the first proc (ns from step start)
        self.span_of: dict = {}  # (proc, idx) -> (module, call, parent)
        self.max_call = collections.Counter()
        ph = ",".join("?" * len(procs))
        rows = []
        for proc, first, last in con.execute(
                f"SELECT proc, span_first, span_last FROM steps WHERE step=? AND proc IN ({ph})", (step, *procs)):
            if first is not None:
                rows += con.execute(
                    "SELECT proc, idx, parent, module_id, call, t0, dur, layout_id, fp_pre, fp_post, n_pre "
                    "FROM spans WHERE rowid BETWEEN ? AND ? AND step=?", (first, last, step)).fetchall()
        rows.sort(key=lambda r: procs.index(r[0]))
        for proc, idx, parent, mid, call, t0, dur, lay, fp_pre, fp_post, n_pre in rows:
            module = modules[mid]
            self.span_of[(proc, idx)] = (module, call, parent)
            self.max_call[module] = max(self.max_call[module], call)
            d = fps[proc]
            for i, (slot, shape, dtype, _dev) in enumerate(layouts.get(lay, ())):
                ref = (fp_pre + i if fp_pre >= 0 else -1) if i < n_pre else (
                    fp_post + i - n_pre if fp_post >= 0 else -1)
                key = (module, call, slot)
                self.points.setdefault(key, {})[proc] = T(shape, dtype, d.get(ref))
                if proc == procs[0]:
                    self.times[key] = (t0 if i < n_pre else t0 + dur, idx, i)
        self.colls: dict = {}  # (group, seq) -> _Coll with per-proc ins/outs
        for (proc, idx, parent, op, redop, gid, seq, t0, dur, lay, fp_pre, fp_post, n_pre, nbytes,
             gname, granks) in con.execute(
                f"SELECT c.proc, c.idx, c.parent, c.op, c.reduce_op, c.group_id, c.seq, c.t0, c.dur, "
                f"c.layout_id, c.fp_pre, c.fp_post, c.n_pre, c.bytes, g.name, g.ranks FROM collectives c "
                f"JOIN groups g USING(group_id) WHERE c.step=? AND c.proc IN ({ph})", (step, *procs)):
            key = (gid, seq)
            c = self.colls.get(key)
            if c is None:
                c = _Coll()
                c.key, c.op, c.reduce_op, c.group, c.seq = key, op, redop, gid, seq
                c.ins, c.outs, c.bytes, c.t_end, c.t0, c.module = {}, {}, nbytes, None, None, None
                c.group_name, c.group_ranks = gname, json.loads(granks)
                self.colls[key] = c
            d = fps[proc]
            slots = layouts.get(lay, ())
            ins = [T(s[1], s[2], d.get(fp_pre + i) if fp_pre >= 0 else None)
                   for i, s in enumerate(slots[:n_pre])]
            outs = [T(s[1], s[2], d.get(fp_post + i) if fp_post >= 0 else None)
                    for i, s in enumerate(slots[n_pre:])]
            c.ins[proc], c.outs[proc] = ins, outs
            if proc == procs[0]:
                c.t_end, c.t0 = t0 + dur, t0
                owner = self.span_of.get((proc, parent))
                c.module = owner[0] if owner else None
        self.coll_list = sorted((c for c in self.colls.values() if c.t_end is not None),
                                key=lambda c: c.t_end)
        self.coll_ends = [c.t_end for c in self.coll_list]
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

    def after(self, t_point, ops, limit=WINDOW):
        """Up to ``limit`` collectives of ``ops`` ending at or after ``t_point``, nearest first."""
        out = []
        for c in self.coll_list[bisect.bisect_left(self.coll_ends, t_point):]:
            if c.op in ops:
                out.append(c)
                if len(out) >= limit:
                    break
        return out

    def before(self, t_point, ops, limit=WINDOW):
        """Up to ``limit`` collectives of ``ops`` ending by ``t_point``, nearest first."""
        out = []
        for c in reversed(self.coll_list[:bisect.bisect_right(self.coll_ends, t_point)]):
            if c.op in ops:
                out.append(c)
                if len(out) >= limit:
                    break
        return out


def point_name(module: str, call: int, slot: str, multi_call: bool) -> str:
    if module.startswith("capture:"):  # a named capture point is its own name
        return f"{module}#{call}" if multi_call else module
    return f"{module}#{call}:{slot}" if multi_call else f"{module}:{slot}"


def coll_desc(c: _Coll) -> str:
    op = f"{c.op}({c.reduce_op})" if c.reduce_op else c.op
    where = f", issued by {c.module or '<root>'}"
    return f"{op} #{c.seq} of group {c.group_name} {c.group_ranks}{where}"


def coll_json(c: _Coll, proc) -> dict:
    ts = c.ins.get(proc) or c.outs.get(proc) or []
    t = ts[0] if ts else None
    return dict(op=c.op, reduce_op=c.reduce_op, group=c.group_name, group_ranks=c.group_ranks, seq=c.seq,
                shape=list(t.shape) if t else None, dtype=t.dtype if t else None, bytes=c.bytes,
                module=c.module)


def _fmt_fp(t: T) -> str:
    if t.fp is None:
        return "no fingerprint"
    s, q = t.fp
    return f"sum {s:.6g}, sumsq {q:.6g}" if q is not None else f"sum {s:.6g}"


class Judge:
    """Verdicts for the points of one TP group in one step."""

    def __init__(self, view: StepView, params: dict, rank_of: dict):
        self.v = view
        self.params = params  # (proc, module) -> [(name, shape, fp)]
        self.rank_of = rank_of
        self.done: dict = {}  # key -> verdict dict
        self.by_fp0: dict = {}  # fingerprint on the first proc -> key (a producer of these values)

    def ranks(self, procs):
        return sorted(self.rank_of[p] for p in procs)

    def judge_all(self) -> dict:
        v = self.v
        for key in sorted(v.points, key=lambda k: v.times.get(k, (1 << 62, 0, 0))):
            self.done[key] = verdict = self.judge(key, v.points[key])
            first = next((v.points[key][p] for p in v.procs if p in v.points[key]), None)
            verdict["fp"] = list(first.fp) if first is not None and first.fp is not None else None
            t0 = v.points[key].get(v.procs[0])
            if t0 is not None and t0.fp is not None and key[2].startswith("output"):
                self.by_fp0.setdefault((t0.fp, t0.numel), key)
        return self.done

    def judge(self, key, obs: dict) -> dict:
        v = self.v
        module, call, slot = key
        procs = [p for p in v.procs if p in obs]
        ev: list = []
        shapes = {self.rank_of[p]: list(obs[p].shape) for p in procs}
        dtypes = {self.rank_of[p]: obs[p].dtype for p in procs}
        out = dict(shapes=shapes, dtypes=dtypes, evidence=ev, collective=None)
        if len(v.procs) == 1:
            ev.append("one rank in its TP group: every tensor is whole")
            return dict(out, placement="replicate", reduction="no-reduction")
        if len(procs) < len(v.procs):
            ev.append(f"seen on ranks {self.ranks(procs)} only, of {self.ranks(v.procs)}")
        if len(procs) < 2:
            return dict(out, placement="unknown", reduction="unknown")
        ts = [obs[p] for p in procs]
        tref = ts[0]
        t_point = v.times.get(key, (0, 0, 0))[0]
        # 1. shapes
        if len({t.shape for t in ts}) > 1:
            ndims = {len(t.shape) for t in ts}
            if len(ndims) == 1:
                diff = [d for d in range(len(tref.shape)) if len({t.shape[d] for t in ts}) > 1]
                if len(diff) == 1:
                    ev.append(f"shapes differ only along dim {diff[0]}: " + ", ".join(
                        f"rank {self.rank_of[p]} {list(obs[p].shape)}" for p in procs))
                    return dict(out, placement=f"shard({diff[0]})", reduction="no-reduction")
            ev.append("shapes differ in more than one dimension: " + ", ".join(
                f"rank {self.rank_of[p]} {list(obs[p].shape)}" for p in procs))
            return dict(out, placement="divergent", reduction="unknown")
        ev.append(f"same shape {list(tref.shape)} {tref.dtype} on ranks {self.ranks(procs)}")
        if any(t.fp is None for t in ts):
            ev.append("no fingerprints for these values (recorded with --no-fingerprint or in a "
                      "CUDA-graph capture): placement needs them")
            return dict(out, placement="unknown", reduction="unknown")
        # 2. replicate?
        if all(fp_equal(tref, t) for t in ts[1:]):
            ev.append(f"values equal on every rank ({_fmt_fp(tref)})")
            return dict(out, placement="replicate", **self._replicate_reduction(obs, t_point, ev))
        ev.append("values differ across ranks: " + "; ".join(
            f"rank {self.rank_of[p]} {_fmt_fp(obs[p])}" for p in procs))
        # 3. collectives linked by fingerprint
        sum_reductions = [c for c in v.after(t_point, REDUCING - REDUCE_SCATTER) if c.reduce_op in SUM_OPS]
        for c in sum_reductions:
            ins = {p: c.ins[p][0] for p in procs if c.ins.get(p)}
            scale = linked(obs, ins)
            if scale is not None:
                ev.append(f"is the input of {coll_desc(c)} on every rank"
                          + (f" (times {scale:.4g})" if scale != 1.0 else "")
                          + ": a partial sum that this reduction completes")
                return dict(out, placement="partial", reduction="pre-reduction",
                            collective=coll_json(c, procs[0]))
        total = sum(t.fp[0] for t in ts)
        for c in sum_reductions:
            o = c.outs.get(procs[0])
            if o and o[0].numel == tref.numel and o[0].fp is not None and close(
                    total, o[0].fp[0], tref.numel, sum(t.fp[1] or 0 for t in ts), tref.dtype):
                ev.append(f"per-rank sums add up to the output of {coll_desc(c)} "
                          f"({total:.6g}): a partial sum that this reduction completes")
                return dict(out, placement="partial", reduction="pre-reduction",
                            collective=coll_json(c, procs[0]))
        for c in v.before(t_point + 1, REDUCE_SCATTER):
            outs = {p: c.outs[p][0] for p in procs if c.outs.get(p)}
            if linked(outs, obs) is not None:
                ev.append(f"is the output of {coll_desc(c)} on every rank: a reduced slice per rank")
                return dict(out, placement="shard(0)", reduction="post-reduction",
                            collective=coll_json(c, procs[0]))
        for c in v.after(t_point, GATHER):
            ins = {p: c.ins[p][0] for p in procs if c.ins.get(p)}
            if linked(obs, ins) is not None:
                dim = self._concat_dim(tref, ts)
                if dim is None and c.outs.get(procs[0]) and len(c.outs[procs[0]]) == 1:
                    dim = 0
                ev.append(f"is the input of {coll_desc(c)} on every rank: a slice per rank")
                if dim is None:
                    dim = len(tref.shape) - 1
                    ev.append(f"the gathered tensor was not seen; dim {dim} assumed")
                return dict(out, placement=f"shard({dim})", reduction="no-reduction",
                            collective=coll_json(c, procs[0]))
        # 4. the concatenation seen elsewhere
        dim = self._concat_dim(tref, ts)
        if dim is not None:
            ev.append(f"their concatenation along dim {dim} appears in this step")
            return dict(out, placement=f"shard({dim})", reduction="no-reduction")
        # 5. weights, or locally derived from a shard
        if slot.startswith("output"):
            sharded = self._sharded_params(module, procs)
            if sharded:
                name, shape = sharded
                d = next((i for i in range(len(tref.shape) - 1, -1, -1) if tref.shape[i] == shape[0]),
                         len(tref.shape) - 1)
                ev.append(f"{module}.{name} {shape} has equal shapes and different values across "
                          f"ranks: each rank holds a slice of the weight, so of the output")
                return dict(out, placement=f"shard({d})", reduction="no-reduction")
            for (m, cl, s), verdict in self.done.items():
                if m == module and cl == call and s.startswith("input") and (
                        verdict["placement"].startswith("shard") or verdict["placement"] == "partial"):
                    d = len(tref.shape) - 1
                    ev.append(f"derived locally from {verdict['placement']} input {point_name(m, cl, s, False)}")
                    return dict(out, placement=f"shard({d})", reduction="no-reduction")
        else:
            prod = self.by_fp0.get((tref.fp, tref.numel))
            if prod is not None and prod in self.done:
                pv = self.done[prod]
                ev.append(f"the same values as {point_name(*prod, False)} on every rank")
                return dict(out, placement=pv["placement"], reduction=pv["reduction"],
                            collective=pv.get("collective"))
            prev = self._enclosing_shard(key)
            if prev is not None:
                ev.append(f"derived locally (view or slice) from {point_name(*prev, False)}, "
                          f"{self.done[prev]['placement']}, in the same enclosing call")
                return dict(out, placement=f"shard({len(tref.shape) - 1})", reduction="no-reduction")
        ev.append("no partial-sum, gather, concatenation or sharded-weight evidence: the ranks disagree")
        return dict(out, placement="divergent", reduction="unknown")

    def _replicate_reduction(self, obs, t_point, ev) -> dict:
        procs = [p for p in self.v.procs if p in obs]
        best = None
        for c in self.v.before(t_point + 1, REDUCING - REDUCE_SCATTER):  # the latest first
            outs = {p: c.outs[p][0] for p in procs if c.outs.get(p)}
            scale = linked(outs, obs)
            if scale is not None:
                best = (c, scale)
                break
        if best is not None:
            c, scale = best
            ev.append(f"equals the output of {coll_desc(c)} on every rank"
                      + (f" (times {scale:.4g})" if scale != 1.0 else ""))
            return dict(reduction="post-reduction", collective=coll_json(c, procs[0]))
        before = self.v.before(t_point, REDUCING, limit=1)
        tref = obs[procs[0]]
        if before and not tref.dtype.startswith(("float", "bfloat", "complex")):
            ev.append("integer values (ids, positions, lengths): no reduction makes them")
            return dict(reduction="no-reduction", collective=None)
        if before:
            c = before[0]
            ev.append(f"computed after a reduction in this step, the last {coll_desc(c)}")
            return dict(reduction="post-reduction", collective=coll_json(c, procs[0]))
        ev.append("no reduction before it in this step")
        return dict(reduction="no-reduction", collective=None)

    def _concat_dim(self, tref: T, ts: list):
        n = len(ts)
        s_total = sum(t.fp[0] for t in ts)
        q_total = sum(t.fp[1] or 0 for t in ts)
        want = T(tref.shape, tref.dtype, (s_total, q_total))
        want.numel = tref.numel * n
        sums, items = self.v.by_numel.get(tref.numel * n, ((), ()))
        tol = sum_tol(want.numel, q_total, tref.dtype) + 1e-7 * abs(s_total)
        lo = bisect.bisect_left(sums, s_total - 2 * tol)
        hi = bisect.bisect_right(sums, s_total + 2 * tol)
        for _, key, cand in items[lo:hi]:
            if len(cand.shape) != len(tref.shape):
                continue
            diff = [d for d in range(len(tref.shape)) if cand.shape[d] != tref.shape[d]]
            if len(diff) == 1 and cand.shape[diff[0]] == tref.shape[diff[0]] * n and fp_equal(want, cand):
                return diff[0]
        return None

    def _sharded_params(self, module, procs):
        per = [self.params.get((p, module)) for p in procs]
        if any(x is None for x in per):
            return None
        for i, (name, shape, fp) in enumerate(per[0]):
            others = [x[i] for x in per[1:] if i < len(x)]
            if len(others) != len(per) - 1 or any(o[1] != shape for o in others) or fp is None:
                continue
            ref = T(shape, "float32", fp)
            if any(o[2] is not None and not fp_equal(ref, T(shape, "float32", o[2])) for o in others):
                return name, shape
        return None

    def _enclosing_shard(self, key):
        """The latest shard point before ``key`` under the same enclosing module call."""
        v = self.v
        proc = v.procs[0]
        t_key = v.times.get(key)
        if t_key is None:
            return None
        span_idx = t_key[1]
        parent = v.span_of.get((proc, span_idx), (None, None, -1))[2]
        best = None
        for other, verdict in self.done.items():
            if not verdict["placement"].startswith("shard"):
                continue
            t_o = v.times.get(other)
            if t_o is None or t_o >= t_key:
                continue
            if v.span_of.get((proc, t_o[1]), (None, None, -2))[2] == parent or t_o[1] == parent:
                if best is None or t_o > v.times[best]:
                    best = other
        return best


def expected_by_layer(attrs: dict | None, slot: str, ranks: int) -> dict | None:
    """What a framework's layer class says its output is (SGLang's parallel layers), to be
    cross-checked against the evidence, never used instead of it. Output slots only."""
    if not attrs or slot not in ("output", "output.0") or ranks < 2:
        return None
    cls = attrs.get("sglang_class")
    says = f"SGLang's {cls}"
    if cls in ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear"):
        gather = bool(attrs.get("gather_output"))
        return dict(says=f"{says}(gather_output={gather})",
                    placement="replicate" if gather else "shard", reduction=None)
    if cls == "RowParallelLinear":
        reduce = attrs.get("reduce_results", True)
        return dict(says=f"{says}(reduce_results={reduce})",
                    placement="replicate" if reduce else "partial",
                    reduction="post-reduction" if reduce else "pre-reduction")
    if cls == "VocabParallelEmbedding":
        return dict(says=says, placement="replicate", reduction="post-reduction")
    if cls == "ReplicatedLinear":
        return dict(says=says, placement="replicate", reduction=None)
    return None


def _load_params(con, procs) -> dict:
    static = {}
    for proc, first, data, indices in con.execute(
            "SELECT proc, first, data, indices FROM fingerprints WHERE step=?", (schema.PARAMS_STEP,)):
        for i, s, q in schema.fingerprint_pairs(first, data, indices):
            static[(proc, i)] = (s, None if math.isnan(q) else q)
    out: dict = {}
    for proc, path, name, shape, ref in con.execute(
            "SELECT p.proc, m.path, p.name, p.shape, p.fp_index FROM params p JOIN modules m USING(module_id)"):
        out.setdefault((proc, path), []).append((name, tuple(json.loads(shape)), static.get((proc, ref))))
    return out


def tp_groups(con) -> list:
    """Processes partitioned into TP groups: declared ``tp_ranks``, else one group per world."""
    rows = con.execute("SELECT proc, rank, tp_ranks, world_size FROM processes ORDER BY rank IS NULL, rank, proc").fetchall()
    groups: dict = {}
    for proc, rank, tp_ranks, world in rows:
        if rank is None:
            key = ("alone", proc)
        elif tp_ranks:
            key = ("tp", tp_ranks)
        else:
            key = ("world", world)
        groups.setdefault(key, []).append(proc)
    return list(groups.values())


def inferred_tp_ranks(con) -> dict:
    """TP rank per process: as recorded, or the position in its TP group (the merge's grouping:
    declared groups, else all ranks of the world)."""
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    recorded = dict(con.execute("SELECT proc, tp_rank FROM processes WHERE tp_rank IS NOT NULL"))
    out = {}
    for procs in tp_groups(con):
        ranked = sorted((rank_of[p], p) for p in procs if rank_of.get(p) is not None)
        for pos, (_, p) in enumerate(ranked):
            out[p] = recorded.get(p, pos)
    return out


def sample_steps(con, procs) -> list:
    """A few steps every process of the group traced, one set per kind of step (root, mode)."""
    ph = ",".join("?" * len(procs))
    rows = con.execute(
        f"SELECT step, root, attrs FROM steps WHERE proc IN ({ph}) AND t_end IS NOT NULL "
        f"GROUP BY step HAVING COUNT(*) = ? ORDER BY step", (*procs, len(procs))).fetchall()
    kinds: dict = {}
    for step, root, attrs in rows:
        a = json.loads(attrs or "{}")
        kind = (root, a.get("forward_mode"), a.get("captured"), a.get("replay_of") is not None)
        kinds.setdefault(kind, [])
        if len(kinds[kind]) < MAX_SAMPLE_STEPS:
            kinds[kind].append(step)
    return sorted(s for steps in kinds.values() for s in steps)


def compute_verdicts(con) -> int:
    """Fill the ``points`` table; return the number of points."""
    layouts = {lid: json.loads(slots) for lid, slots in con.execute("SELECT layout_id, slots FROM layouts")}
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    rank_of = {p: (r if r is not None else 0) for p, r in con.execute("SELECT proc, rank FROM processes")}
    params = _load_params(con, None)
    per_point: dict = {}
    multi: collections.Counter = collections.Counter()
    for procs in tp_groups(con):
        for step in sample_steps(con, procs):
            view = StepView(con, step, procs, layouts, modules, rank_of)
            for m, c in view.max_call.items():
                multi[m] = max(multi[m], c)
            verdicts = Judge(view, params, rank_of).judge_all()
            for key, verdict in verdicts.items():
                verdict["step"] = step
                verdict["order"] = view.times.get(key, (1 << 62, 0, 0))
                per_point.setdefault(key, []).append(verdict)
    seen_steps = {}  # traced steps each (module, call) was seen in, on the first process
    bounds = con.execute("SELECT MIN(span_first), MAX(span_last) FROM steps WHERE proc = "
                         "(SELECT MIN(proc) FROM steps WHERE span_first IS NOT NULL)").fetchone()
    for mid, call, n in con.execute("SELECT module_id, call, COUNT(*) FROM spans WHERE rowid BETWEEN ? AND ? "
                                    "GROUP BY module_id, call", bounds):
        seen_steps[(modules[mid], call)] = n
    captures = {p: json.loads(i) for p, i in con.execute("SELECT point, info FROM captures")}
    layer_attrs = {m: json.loads(a) for m, a in con.execute("SELECT module, attrs FROM module_attrs")}
    rows = []
    for key, verdicts in per_point.items():
        module, call, slot = key
        counts = collections.Counter((v["placement"], v["reduction"]) for v in verdicts)
        (placement, reduction), _ = counts.most_common(1)[0]
        chosen = next(v for v in verdicts if (v["placement"], v["reduction"]) == (placement, reduction))
        evidence = list(chosen["evidence"])
        if module in captures and captures[module].get("what"):
            evidence.insert(0, f"captures the {captures[module]['what']}")
        evidence.append(f"steps sampled: {sorted({v['step'] for v in verdicts})}")
        if len(counts) > 1:
            evidence.append("other steps disagree: " + ", ".join(
                f"{p}/{r} in {n}" for (p, r), n in counts.items() if (p, r) != (placement, reduction)))
        semantics = expected_by_layer(layer_attrs.get(module), slot, len(chosen["shapes"]))
        if semantics is not None:
            agrees = (placement.startswith("shard(") if semantics["placement"] == "shard"
                      else placement == semantics["placement"])
            if semantics.get("reduction"):
                agrees = agrees and reduction == semantics["reduction"]
            semantics["agrees"] = agrees
            evidence.append(f"{semantics['says']}: {semantics['placement']}"
                            + (f"/{semantics['reduction']}" if semantics.get("reduction") else "")
                            + (" (agrees with the observed evidence)" if agrees else
                               f" -- DISAGREES with the observed {placement}/{reduction}"))
        dts = set(chosen["dtypes"].values())
        rows.append((point_name(module, call, slot, multi[module] > 0), module, call, slot, placement,
                     reduction, json.dumps(chosen["shapes"]), dts.pop() if len(dts) == 1 else None,
                     json.dumps(chosen["dtypes"]) if len(set(chosen["dtypes"].values())) > 1 else None,
                     seen_steps.get((module, call), 0), json.dumps(evidence),
                     json.dumps(chosen["collective"]) if chosen["collective"] else None,
                     json.dumps(verdicts[0]["fp"]) if verdicts[0]["fp"] else None,
                     json.dumps(semantics) if semantics is not None else None,
                     min(v["order"][0] for v in verdicts)))
    rows.sort(key=lambda r: (r[14], r[0]))
    con.executemany("INSERT OR REPLACE INTO points VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [r[:14] + (i,) for i, r in enumerate(rows)])
    return len(rows)
