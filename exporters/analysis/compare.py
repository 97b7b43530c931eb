"""Where do two runs part? Two traces (any TP sizes) compared point by point, step by step,
from their fingerprints and inferred placements alone: no tensor dumped, no dimension annotated.

Alignment. Points are aligned by (module, call, slot). Steps are paired by kind: for a server,
the forward mode and the token count of the step (SGLang's integration records both), the k-th
step of a kind in A with the k-th of that kind in B; for a plain program, in order. Steps that
were captured into a CUDA graph hold no values and are left out. ``steps`` pairs steps
explicitly (an eager step with the replay of the same inputs, in one trace or two).

Unsharding. Each side's tensor is made whole by its placement (the merged store's ``points``
table): ``shard(D)``: the per-rank sums and sums of squares add up to the whole tensor's;
``partial``: the per-rank sums add up to the reduced tensor's sum (its sum of squares is not
recoverable: only the sum is compared); ``replicate``: any rank. A ``divergent`` or ``unknown``
point is compared rank by rank against the other side's whole tensor.

Tolerance. Two fingerprints are compared through two relative errors, each bounded by the
largest elementwise relative error between the tensors (so a tolerance on elements is a
tolerance on them): the norm's, ``|‖a‖ - ‖b‖| / max(‖a‖, ‖b‖)``, and the sum's,
``|Σa - Σb| / (√n · max(‖a‖, ‖b‖))`` (√n·‖x‖ bounds Σ|x|). The runs may differ per element by
rounding at each op before the point, accumulating like a random walk, and by fp32 accumulation
in another order: ``tol = eps(dtype) * sqrt(ops before the point) * order + 2**-24 * sqrt(n)``,
with eps from ``tolerance.py`` (bfloat16 2**-7, float16 2**-10, float32 2**-20) of the coarsest
floating-point dtype of the step up to the point (float32 logits of a bfloat16 model carry
bfloat16 rounding), and ``order`` 2
where the runs reduce in another order (other TP sizes), else 1.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re

from tensor_trace.errors import NoAnswer
from tensor_trace.exporters.analysis.compare_steps import Side, pair_steps, parse_steps, with_values
from tensor_trace.exporters.analysis.compare_vector import PairColumns
from tensor_trace.exporters.analysis.tolerance import eps

SAME, DIFFERS, NOT_COMPARABLE, ONLY_A, ONLY_B = "same", "differs", "not comparable", "only in A", "only in B"
_FLOAT = ("float", "bfloat", "complex")
TOL_FORMULA = "eps(dtype) * sqrt(ops before the point) * order + 2**-24 * sqrt(numel)"
TOL_DTYPE = "the coarsest floating-point dtype of the step up to the point (in either run)"


class Whole:
    """One side's tensor at a point, made whole by its placement."""

    __slots__ = ("numel", "shape", "dtype", "s", "q", "how", "ranks", "q_bound", "ranks_local")

    def __init__(self, numel, shape, dtype, s, q, how, ranks=None, q_bound=None):
        self.numel, self.shape, self.dtype, self.s, self.q, self.how = numel, shape, dtype, s, q, how
        self.ranks = ranks  # per-rank Wholes, for a point compared rank by rank
        self.q_bound = q_bound  # a partial sum's: an upper bound of the reduced sum of squares
        self.ranks_local = None  # a shard's per-rank tensors, for a fallback rank by rank


def unshard(per: list, placement: str, size: int):
    """The whole tensor from its per-rank (shape, dtype, fp); None where a rank is missing or
    has no fingerprint (``per`` in TP-rank order)."""
    if size == 1 or len(per) == 1 or placement == "replicate":
        for r, x in enumerate(per):  # any rank
            if x is not None and x[2] is not None:
                shape, dtype, (s, q) = x
                return Whole(math.prod(shape) if shape else 1, shape, dtype, s, None if q != q else q,
                             f"rank {r}" if len(per) > 1 else "whole")
        return None
    if any(x is None or x[2] is None for x in per):
        return None
    per = [(x[0], x[1], (x[2][0], None if x[2][1] != x[2][1] else x[2][1])) for x in per]  # NaN: none
    shape, dtype, fp = per[0]
    numel = math.prod(shape) if shape else 1
    if placement.startswith("shard("):
        d = int(placement[6:-1])
        if any(len(x[0]) != len(shape) for x in per) or d >= len(shape):
            return None
        whole = list(shape)
        whole[d] = sum(x[0][d] for x in per)
        q = None if any(x[2][1] is None for x in per) else sum(x[2][1] for x in per)
        w = Whole(math.prod(whole), tuple(whole), dtype, sum(x[2][0] for x in per), q,
                  f"sum of {len(per)} shards along dim {d}")
        w.ranks_local = _per_rank(per)
        return w
    if placement == "partial":
        if any(x[0] != shape for x in per) or any(x[2][1] is None for x in per):
            return None
        bound = sum(math.sqrt(max(x[2][1], 0.0)) for x in per) ** 2  # the norm's triangle inequality
        return Whole(numel, shape, dtype, sum(x[2][0] for x in per), None,
                     f"sum of {len(per)} partial sums, sum only", q_bound=bound)
    # divergent / unknown: rank by rank
    return Whole(numel, shape, dtype, fp[0], fp[1], f"{placement}: rank by rank", _per_rank(per))


def _per_rank(per) -> list:
    return [Whole(math.prod(x[0]) if x[0] else 1, x[0], x[1], x[2][0], x[2][1], f"rank {i}")
            for i, x in enumerate(per)]


class Tolerance:
    """The tolerance of one comparison (see the module docstring)."""

    def __init__(self, size_a: int, size_b: int, steps_differ: bool):
        self.order = 2.0 if size_a != size_b or steps_differ else 1.0
        self.why = (f"TP {size_a} against TP {size_b}: another reduction order" if size_a != size_b else
                    "other steps: another execution" if steps_differ else f"same TP size ({size_a})")

    def of(self, dtype_a, dtype_b, numel: int, ops: int, computed_in=()) -> float:
        """``computed_in``: the coarsest dtypes of the steps up to the point (values are as
        coarse as what they were computed from)."""
        if not any(str(d).startswith(_FLOAT) for d in (dtype_a, dtype_b)):
            return 0.0  # ids, positions, masks: equal or not
        e = max([eps(d) for d in (dtype_a, dtype_b) if str(d).startswith(_FLOAT)]
                + [eps(d) for d in computed_in])
        return e * math.sqrt(max(ops, 1)) * self.order + 2.0 ** -24 * math.sqrt(max(numel, 1))

    def describe(self) -> dict:
        return dict(formula=TOL_FORMULA, dtype=TOL_DTYPE, order=self.order, reason=self.why, integers="exact",
                    eps={"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -20},
                    measures="relative error of the norm |‖a‖-‖b‖|/max, and of the sum |Σa-Σb|/(√n·max‖·‖): "
                             "each at most the largest elementwise relative error")


def rel_errors(wa: Whole, wb: Whole, per_a=None, per_b=None) -> tuple:
    """(relative error, what it measured) of two whole tensors of the same size."""
    qa, qb = wa.q, wb.q
    if not all(math.isfinite(v) for v in (wa.s, wb.s, qa, qb, wa.q_bound, wb.q_bound) if v is not None):
        return None, "non-finite values (NaN or inf): their sums say nothing"
    if qa is None and qb is None and wa.q_bound is None and wb.q_bound is None:
        # integer or boolean values fingerprinted by their sum alone: exact
        return (0.0 if wa.s == wb.s else 1.0), "exact sum (no sum of squares for this kind)"
    norms = [math.sqrt(max(q, 0.0)) for q in (qa, qb) if q is not None]
    if not norms:  # both partial: the bounds of their norms
        norms = [math.sqrt(max(q, 0.0)) for q in (wa.q_bound, wb.q_bound) if q is not None]
    top = max(norms)
    if top <= 0.0:
        return (0.0 if wa.s == wb.s == 0.0 else 1.0), "zero tensor"
    sum_err = abs(wa.s - wb.s) / (math.sqrt(wa.numel) * top)
    if qa is not None and qb is not None:
        norm_err = abs(math.sqrt(max(qa, 0.0)) - math.sqrt(max(qb, 0.0))) / top
        return max(norm_err, sum_err), ("norm" if norm_err >= sum_err else "sum")
    return sum_err, "sum (one side is partial: its sum of squares is not recoverable)"


def compare_pair(wa: Whole, wb: Whole) -> tuple:
    """(relative error, measured, reason not comparable)."""
    if wa.ranks is not None or wb.ranks is not None:
        # a rank-by-rank side: every rank against the other's whole (or the same rank)
        ra = wa.ranks or [wa]
        rb = wb.ranks or [wb]
        if len(ra) != len(rb) and len(ra) > 1 and len(rb) > 1:
            return None, None, f"divergent at two TP sizes ({len(ra)} and {len(rb)} ranks)"
        worst, what = 0.0, ""
        n = max(len(ra), len(rb))
        for i in range(n):
            x, y = ra[min(i, len(ra) - 1)], rb[min(i, len(rb) - 1)]
            if x.numel != y.numel:
                return None, None, f"rank {i}'s tensor is {list(x.shape)} in A, {list(y.shape)} in B"
            err, m = rel_errors(x, y)
            if err is None:
                return None, None, m
            if err >= worst:
                worst, what = err, f"{m}, rank {i}"
        return worst, what, None
    if wa.numel != wb.numel:
        # A placement of one side that makes no tensor of the other's size (a verdict misled
        # by the bug itself) still leaves its ranks' tensors to compare with the other's whole.
        for x, y, side in ((wa, wb, "A"), (wb, wa, "B")):
            if x.ranks_local is not None and all(r.numel == y.numel for r in x.ranks_local):
                err, what, why = compare_pair(Whole(x.numel, x.shape, x.dtype, x.s, x.q, x.how, x.ranks_local),
                                              y) if side == "A" else compare_pair(
                    y, Whole(x.numel, x.shape, x.dtype, x.s, x.q, x.how, x.ranks_local))
                if err is not None:
                    return err, f"{what}; {side}'s {x.how} would be {list(x.shape)}: compared rank by rank", None
        return None, None, f"whole shapes differ: {list(wa.shape)} in A, {list(wb.shape)} in B"
    err, what = rel_errors(wa, wb)
    if err is None:
        return None, None, what
    return err, what, None


def _fmt(w: Whole) -> str:
    q = f", sumsq {w.q:.6g}" if w.q is not None else ""
    return f"sum {w.s:.6g}{q} ({w.how}, {list(w.shape)} {w.dtype})"


def _fmt_at(w: Whole, what: str) -> str:
    """A side's values where the error was measured: a rank-by-rank side's rank that measured
    it (``what`` ends ", rank I"), not its first rank's (which may be the one that agrees)."""
    hit = re.search(r"rank (\d+)", what or "")
    if hit is None or not w.ranks:
        return _fmt(w)
    i = int(hit.group(1))
    r = w.ranks[min(i, len(w.ranks) - 1)]
    q = f", sumsq {r.q:.6g}" if r.q is not None else ""
    return f"rank {i}: sum {r.s:.6g}{q} ({w.how}, {list(r.shape)} {r.dtype})"


def compare(con_a, con_b, pattern: str | None = None, steps=None, vector: bool = True) -> dict:
    """The contract's ``compare`` object: ``first_divergence``, ``points``, ``tolerance``
    (plus ``steps``, the pairs whose values were compared, ``unpaired``, and
    ``steps_not_fingerprinted``: pairs whose values were not compared because a side's step took
    no fingerprints; their structure, shapes and dtypes still are, so a point in one run only or
    a changed layout on such a step is reported). ``vector``: settle the plain points
    of aligned steps by columns (``compare_vector``; the same results), else point by point."""
    a, b = Side(con_a, "A"), Side(con_b, "B")
    explicit = parse_steps(steps)
    pairs, left_a, left_b = pair_steps(a, b, explicit)
    tol = Tolerance(a.size, b.size, any(sa != sb for sa, sb in explicit))
    if not pairs:
        raise NoAnswer(f"no step of A pairs with a step of B (A has {len(a.steps)} complete step(s), B "
                       f"{len(b.steps)}, of other kinds); pair them with --steps A:B")
    valued, no_values = with_values(a, b, pairs)
    skip_values = set(no_values)

    def wanted(key) -> bool:
        if pattern is None:
            return True
        name = (a.points.get(key) or b.points.get(key) or (None,))[0] or f"{key[0]}#{key[1]}:{key[2]}"
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name.split(":")[0], pattern) \
            or fnmatch.fnmatchcase(key[0], pattern)

    results: dict = {}  # key -> dict
    first = None
    matched: dict = {}  # (plan A, plan B) -> the points of both, with what the fast path needs
    vectors: dict = {}  # (plan A, plan B) -> their common points by columns (compare_vector)
    sel = wanted if pattern else None
    for pair_i, (sa, sb) in enumerate(pairs):
        da, db = a.read_step(sa, sel, vector), b.read_step(sb, sel, vector)
        fast = da.aligned and db.aligned
        plan_key = (id(da.plan), id(db.plan)) if fast else None
        m = matched.get(plan_key) if fast else None
        if m is None:
            m = _match(a, b, da, db, tol) if fast else None
            if fast:
                matched[plan_key] = m
        if m is not None:
            common, only_a, only_b = m
        else:
            ka, kb = set(da.keys), set(db.keys)
            common = [(k, None, None, SLOW, SLOW, 0, 0.0) for k in da.keys if k in kb]
            only_a = [k for k in da.keys if k not in kb]
            only_b = [k for k in db.keys if k not in ka]
        for key in only_a:
            _result(results, key, da, db)["in_a"] = True
        for key in only_b:
            _result(results, key, da, db)["in_b"] = True
        entries = common
        if (sa, sb) in skip_values:
            # no fingerprints on a side: the point is in both runs, its values are not compared
            for key, *_ in common:
                r = results.get(key)
                if r is None or not r["in_b"] or not r["in_a"]:
                    r = _result(results, key, da, db)
                    r["in_a"] = r["in_b"] = True
                r["unvalued"] = True
            continue
        if m is not None and da.values is not None and db.values is not None:
            vec = vectors.get(plan_key)
            if vec is None:
                for key, *_ in common:  # as the loop below does for each point it is handed
                    r = results.get(key)
                    if r is None or not r["in_b"] or not r["in_a"]:
                        r = _result(results, key, da, db)
                        r["in_a"] = r["in_b"] = True
                vec = vectors[plan_key] = PairColumns(common, results)
            entries = [common[i] for i in vec.settle(da.values, db.values)]
        for key, ia, ib, cat_a, cat_b, numel, t in entries:
            r = results.get(key)
            if r is None or not r["in_b"] or not r["in_a"]:
                r = _result(results, key, da, db)
                r["in_a"] = r["in_b"] = True
            if cat_a is not SLOW and cat_b is not SLOW:
                wa, wb = _fast_whole(da.cols, ia, cat_a), _fast_whole(db.cols, ib, cat_b)
                if wa is not None and wb is not None:
                    err = _fast_err(wa, wb, numel)
                    if err <= t:
                        r["steps"] += 1
                        if r["rel_error"] is None or err > r["rel_error"]:
                            r["rel_error"], r["tol"] = err, t
                        continue
            # the slow path: anything not plainly the same, with the details of why
            wa = unshard(da.per(key), a.placement(key), a.size)
            wb = unshard(db.per(key), b.placement(key), b.size)
            if wa is None or wb is None:
                r["reason"] = r["reason"] or ("a rank's tensor or fingerprint is missing in "
                                              + ("A" if wa is None else "B"))
                continue
            err, what, why = compare_pair(wa, wb)
            if err is None:
                r["reason"] = r["reason"] or why
                continue
            ops = (da.order(key) or db.order(key) or (0, 1))[1]
            t = tol.of(wa.dtype, wb.dtype, max(wa.numel, wb.numel), ops, _computed_in(key, da.plan, db.plan))
            r["steps"] += 1
            if r["rel_error"] is None or err > r["rel_error"]:
                r["rel_error"], r["tol"] = err, t
            if err > t and r["status"] != DIFFERS:
                r["status"] = DIFFERS
                r["first_bad"] = (sa, sb, err, t, what, wa, wb)
                rank = (pair_i, r["order"])
                if first is None or rank < first[0]:
                    first = (rank, key)
    points = []
    for key, r in sorted(results.items(), key=lambda kv: (kv[1]["order"], kv[0])):
        ent_a, ent_b = a.points.get(key), b.points.get(key)
        name = (ent_a or ent_b or (f"{key[0]}:{key[2]}",))[0]
        if not r["in_b"]:
            status = ONLY_A
        elif not r["in_a"]:
            status = ONLY_B
        elif r["status"] == DIFFERS:
            status = DIFFERS
        elif r["steps"]:
            status = SAME
        else:
            status = NOT_COMPARABLE
        row = dict(point=name, status=status, rel_error=_round(r["rel_error"]), tolerance=_round(r["tol"]),
                   placement_a=ent_a[1] if ent_a else None, placement_b=ent_b[1] if ent_b else None,
                   steps_compared=r["steps"])
        if status == NOT_COMPARABLE:
            row["reason"] = r["reason"] or ("values not compared: no step pair holding it was fingerprinted in "
                                            "both runs" if r.get("unvalued") else "no step of both runs holds it")
        points.append(row)
        r["row"] = row
    if pattern and not points:
        raise NoAnswer(f"no point matches {pattern!r} in either trace")
    first_div = None
    if first is not None:
        key = first[1]
        r = results[key]
        sa, sb, err, t, what, wa, wb = r["first_bad"]
        first_div = dict(point=r["row"]["point"], step_a=sa, step_b=sb, rel_error=_round(err), tolerance=_round(t),
                         detail=(f"relative error {err:.3g} ({what}) > tolerance {t:.3g}: "
                                 f"A {_fmt_at(wa, what)}; B {_fmt_at(wb, what)}"),
                         evidence=_evidence(a, b, key, wa, wb, results))
    return dict(first_divergence=first_div, points=points, tolerance=tol.describe(),
                steps=[list(p) for p in valued], unpaired=dict(a=left_a, b=left_b),
                steps_not_fingerprinted=[list(p) for p in no_values],
                groups=dict(a=dict(ranks=a.ranks, size=a.size), b=dict(ranks=b.ranks, size=b.size)))


SLOW = "slow"
_REP, _SHARD, _PARTIAL = "rep", "shard", "partial"


def _result(results, key, da, db) -> dict:
    r = results.get(key)
    if r is None:
        r = results[key] = dict(status=None, rel_error=None, tol=None, steps=0, reason=None, in_a=False,
                                in_b=False, order=da.order(key) or db.order(key) or (1 << 62, 0))
    return r


def _fast_kind(side, plan, i):
    """How the fast path unshards a point of this side (None: the slow path), and the whole
    tensor's numel."""
    shape, _dtype = plan.meta[i]
    numel = math.prod(shape) if shape else 1
    placement = side.placement(plan.keys[i])
    n = len(side.procs)
    if side.size == 1 or n == 1 or placement == "replicate":
        return _REP, numel
    if placement.startswith("shard("):
        return _SHARD, numel * n  # every process of one plan: equal shapes, even shards
    if placement == "partial":
        return _PARTIAL, numel
    return SLOW, numel


def _computed_in(key, pa, pb) -> set:
    """The coarsest floating-point dtypes of both steps up to the point."""
    out = set()
    for plan in (pa, pb):
        i = plan.index.get(key)
        if i is not None and plan.coarsest[i] is not None:
            out.add(plan.coarsest[i])
    return out


def _match(a, b, da, db, tol) -> tuple:
    """The points of two step structures: (common, only in A, only in B), each common point
    with its positions, fast-path kinds, numel and tolerance."""
    pa, pb = da.plan, db.plan
    common, only_a = [], []
    for ia, key in enumerate(pa.keys):
        ib = pb.index.get(key)
        if ib is None:
            only_a.append(key)
            continue
        cat_a, n_a = _fast_kind(a, pa, ia)
        cat_b, n_b = _fast_kind(b, pb, ib)
        if n_a != n_b:
            cat_a = cat_b = SLOW
        ops = pa.times[ia][1]
        t = tol.of(pa.meta[ia][1], pb.meta[ib][1], max(n_a, n_b), ops, _computed_in(key, pa, pb))
        common.append((key, ia, ib, cat_a, cat_b, n_a, t))
    only_b = [k for k in pb.keys if k not in pa.index]
    return common, only_a, only_b


def _fast_whole(cols, i, kind):
    """(sum, sum of squares or NaN, bound of a partial's sum of squares or None)."""
    if kind is _REP:
        for c in cols:
            v = c[i]
            if v is not None:
                return v[0], v[1], None
        return None
    s = q = 0.0
    if kind is _SHARD:
        for c in cols:
            v = c[i]
            if v is None:
                return None
            s += v[0]
            q += v[1]
        return s, q, None
    for c in cols:
        v = c[i]
        if v is None or v[1] != v[1]:
            return None
        s += v[0]
        q += math.sqrt(v[1]) if v[1] > 0.0 else 0.0
    return s, math.nan, q * q


def _fast_err(wa, wb, numel) -> float:
    """``rel_errors`` on plain tuples (the same arithmetic)."""
    sa, qa, ba = wa
    sb, qb, bb = wb
    ok_a, ok_b = qa == qa, qb == qb
    if not ok_a and not ok_b and ba is None and bb is None:
        return 0.0 if sa == sb else 1.0
    if ok_a or ok_b:
        top = math.sqrt(max(max(qa, 0.0) if ok_a else 0.0, max(qb, 0.0) if ok_b else 0.0))
    else:
        top = math.sqrt(max(ba, bb))
    if top <= 0.0:
        return 0.0 if sa == sb == 0.0 else 1.0
    sum_err = abs(sa - sb) / (math.sqrt(numel) * top)
    if ok_a and ok_b:
        return max(abs(math.sqrt(max(qa, 0.0)) - math.sqrt(max(qb, 0.0))) / top, sum_err)
    return sum_err


def _evidence(a: Side, b: Side, key, wa: Whole, wb: Whole, results: dict) -> list:
    """Why the first divergence is believed: each side's placement and its reason, the scale
    between the two, and whether the same call's inputs agreed."""
    out = []
    for side, w in ((a, wa), (b, wb)):
        ent = side.points.get(key)
        if ent is None:
            continue
        items = json.loads(ent[3]) if ent[3] else []
        from tensor_trace.exporters.analysis.evidence import key_item

        hit = key_item(items)
        out.append(f"{side.label} (TP {side.size}): {ent[1]}/{ent[2]}" + (f": {hit['text']}" if hit else ""))
    if wa.q and wb.q and wa.q > 0 and wb.q > 0:
        scale = math.sqrt(wb.q / wa.q)
        out.append(f"norm of B / norm of A = {scale:.4g}")
        for n, side in ((b.size, "B"), (a.size, "A")):
            big = scale if side == "B" else 1.0 / scale
            if n > 1 and abs(big - n) <= 1e-2 * n:
                out.append(f"{side} holds {n} times the values: the TP size of {side}, as a sum-reduction of "
                           f"values already replicated gives (a double reduction? see tensor-trace check)")
    module, call, slot = key
    if slot.startswith("output"):
        ins = [r for k, r in results.items() if k[0] == module and k[1] == call and k[2].startswith("input")]
        if ins:
            bad = [r["row"]["point"] for r in ins if r["row"]["status"] == DIFFERS]
            out.append(f"the call's inputs differ too: {', '.join(bad)}" if bad else
                       f"the call's {len(ins)} input(s) agree: the values part inside {module}")
    return out


def _round(x):
    return None if x is None else float(f"{x:.4g}")
