"""Findings that need no second run: what one trace shows wrong by itself.

Each finding is ``{kind, point, collective, detail, evidence}`` (the contract's ``check``):

- ``double-reduction``: a sum-reduction of values already replicated, the output of an earlier
  sum-reduction: its output is N times its input (SGLang #37187 under DP attention);
- ``all-reduce-gathers``: an all_reduce whose inputs are zero outside one slice each: a gather
  paid for as a reduction;
- ``foreign-group-reduction``: a sum-reduction over ranks outside the process's declared TP
  group;
- ``pre-reduction-capture``: a partial sum captured into a named capture point or put into a
  concatenation (SGLang #28925, #34668: a capture that a fusion left before the reduction);
- ``divergent``: a point whose ranks disagree with no evidence of a partial sum or a shard;
- ``collective-skipped`` / ``collective-mismatch``: ranks that skipped a collective the others
  issued, or issued another op, shape or dtype (matched by group and sequence number);
- ``divergent-parameter``: a parameter a DTensor declares replicated whose values differ across
  the ranks of its TP group;
- ``collective-error``: a collective that raised on some rank, with the ranks of its group that
  never issued it (a TP worker that crashed: alignment leaves a rank whose trace stops early out).

Collectives are examined in the steps the verdicts sampled (a few per kind of step).
"""

from __future__ import annotations

import json

from tensor_trace import schema
from tensor_trace.exporters.analysis.evidence import key_item
from tensor_trace.exporters.analysis.step_view import REDUCE_SCATTER, StepView, coll_desc, coll_json
from tensor_trace.exporters.analysis.tolerance import all_equal, linked
from tensor_trace.exporters.analysis.verdicts import StoreContext, load_params, sample_steps, tp_groups_with_size
from tensor_trace.format.points import CAPTURE_PREFIX, full_name

_FLOAT = ("float", "bfloat")
_CONCAT_OPS = ("cat", "concat", "stack", "hstack", "vstack")


def finding(kind, point, collective, detail, evidence) -> dict:
    return dict(kind=kind, point=point, collective=collective, detail=detail, evidence=list(evidence))


def check(con) -> list:
    """Every finding of the trace, in execution order within each kind's pass."""
    points = _points(con)
    out = []
    out += _collective_findings(con, points)
    captures = _capture_findings(con, points)
    out += captures
    explained = {f["point"] for f in captures}
    out += _divergent_findings(p for name, p in points.items() if name not in explained)
    out += _issue_findings(con)
    out += _raised_findings(con)
    out += _replicated_parameter_findings(con)
    return out


def _replicated_parameter_findings(con) -> list:
    """``divergent-parameter``: a parameter that a DTensor declares replicated over its TP mesh
    whose values differ across the ranks of its TP group (a rank's stale or scaled copy: under
    sequence parallelism a norm's output is a shard either way, and only its weight tells)."""
    from tensor_trace.exporters.analysis.declared import dtensor_placement
    from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal

    params = load_params(con)
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    out = []
    for procs in [procs for procs, _ in tp_groups_with_size(con)]:
        modules = sorted({m for p, m in params if p in procs})
        for module in modules:
            per = [params.get((p, module)) for p in procs]
            if any(x is None for x in per):
                continue
            for i, (name, shape, fp, meta) in enumerate(per[0]):
                if fp is None or dtensor_placement(meta, len(shape)) != "replicate":
                    continue
                rows = [x[i] for x in per if i < len(x) and x[i][0] == name]
                ref = Observed(shape, "float32", fp)
                odd = [rank_of.get(p) for p, r in zip(procs, rows)
                       if r[2] is not None and not fp_equal(ref, Observed(shape, "float32", r[2]))]
                if len(rows) != len(per) or not odd:
                    continue
                fps = ", ".join(f"rank {rank_of.get(p)} sum {r[2][0]:.6g}" for p, r in zip(procs, rows) if r[2])
                out.append(finding("divergent-parameter", f"{module}.{name}", None,
                                   f"{module}.{name} {list(shape)} is a DTensor declared Replicate() over its TP "
                                   f"mesh, but its values differ on rank(s) {odd} from rank {rank_of.get(procs[0])}'s",
                                   [fps]))
    return out


def _points(con) -> dict:
    rows = con.execute("SELECT point, module, call, slot, placement, reduction, rule, collective, "
                       "evidence_items FROM points ORDER BY sort_key").fetchall()
    return {r[0]: dict(point=r[0], module=r[1], call=r[2], slot=r[3], placement=r[4], reduction=r[5],
                       rule=r[6], collective=json.loads(r[7]) if r[7] else None,
                       items=json.loads(r[8]) if r[8] else []) for r in rows}


def _carrier(view, judge_name, c, proc0):
    """The point whose values are collective ``c``'s output (the issuing module's first), or
    its input, else the issuing module's output; None if there is none."""
    outs = {p: c.outs[p][0] for p in view.procs if c.outs.get(p)}
    ins = {p: c.ins[p][0] for p in view.procs if c.ins.get(p)}
    best = None
    for key, obs in view.points.items():
        t = obs.get(proc0)
        if t is None or t.fp is None:
            continue
        for side, sel in ((outs, 0), (ins, 1)):
            if side and side.get(proc0) is not None and t.numel == side[proc0].numel \
                    and linked(side, obs) == 1.0:
                rank = (sel, key[0] != c.module, view.times.get(key, (1 << 62,))[0])
                if best is None or rank < best[0]:
                    best = (rank, key)
    if best is None and c.module:
        # no point holds its values (a bias added after it): the issuing module's output, which
        # is where the user looks (its first output slot in the step)
        outputs = sorted((view.times.get(key, (1 << 62,))[0], key) for key in view.points
                         if key[0] == c.module and key[2].startswith("output"))
        if outputs:
            return judge_name(outputs[0][1])
    return judge_name(best[1]) if best else None


def _collective_findings(con, points) -> list:
    ctx = StoreContext(con)
    names = {(p["module"], p["call"], p["slot"]): p["point"] for p in points.values()}
    out, seen = [], set()
    declared = _declared_tp_ranks(con)
    for procs, size in tp_groups_with_size(con):
        if size < 2 or len(procs) < size:
            continue
        tp_ranks = declared.get(procs[0])
        for step in sample_steps(con, procs):
            view = StepView(con, step, procs, ctx.layouts, ctx.modules, ctx.rank_of)
            p0 = procs[0]

            def name(key):
                return names.get(key) or full_name(*key)

            for c in view.coll_list:
                where = (c.module, c.op, c.group_name, _position(view, c))
                ins = [c.ins[p][0] for p in procs if c.ins.get(p)]
                outs = [c.outs[p][0] for p in procs if c.outs.get(p)]
                if not c.sums or c.op in REDUCE_SCATTER or len(ins) < len(procs) or len(outs) < len(procs):
                    continue
                cj = coll_json(c, p0)
                if tp_ranks and not set(c.group_ranks) <= set(tp_ranks) and ("foreign", where) not in seen:
                    seen.add(("foreign", where))
                    out.append(finding(
                        "foreign-group-reduction", _carrier(view, name, c, p0), cj,
                        f"{coll_desc(c)} sums over ranks {c.group_ranks}, outside the TP group {tp_ranks}",
                        [f"the processes declare the TP group {tp_ranks}",
                         f"step {step}: the collective's group is {c.group_name} {c.group_ranks}"]))
                if ins[0].fp is None or not ins[0].dtype.startswith(_FLOAT) or not all_equal(ins):
                    continue
                prev = _reduced_before(view, c)
                ins_d = {p: c.ins[p][0] for p in procs}
                outs_d = {p: c.outs[p][0] for p in procs}
                scale = linked(ins_d, outs_d)
                n = len(c.group_ranks)
                if prev is None or scale is None or abs(scale - n) > 1e-3 * n:
                    continue
                if ("double", where) in seen:
                    continue
                seen.add(("double", where))
                s_in, s_out = ins[0].fp, outs[0].fp
                out.append(finding(
                    "double-reduction", _carrier(view, name, c, p0), cj,
                    f"{coll_desc(c)} sums values already reduced by {coll_desc(prev)}: its output is "
                    f"{scale:.4g} times its input (the group has {n} ranks)",
                    [f"step {step}: the input is equal on ranks {sorted(ctx.rank_of[p] for p in procs)} "
                     f"(sum {s_in[0]:.6g}, sumsq {s_in[1]:.6g})",
                     f"the input is the output of {coll_desc(prev)} on every rank",
                     f"the output is {scale:.4g} x the input on every rank (sum {s_out[0]:.6g}, "
                     f"sumsq {s_out[1]:.6g})"]))
    # all_reduces that gather, as the verdicts judged them
    for p in points.values():
        if p["rule"] in ("gathered-by-all-reduce", "gather-by-all-reduce-input"):
            c = p["collective"] or {}
            key = ("gathers", c.get("group"), c.get("seq"))
            if key in seen:
                continue
            seen.add(key)
            hit = key_item(p["items"])
            out.append(finding("all-reduce-gathers", p["point"], p["collective"],
                               f"all_reduce #{c.get('seq')} of group {c.get('group')} {c.get('group_ranks')} "
                               f"(issued by {c.get('module') or '<root>'}) puts slices together: an all_gather's "
                               f"work at an all_reduce's cost", [hit["text"]] if hit else []))
    return out


def _position(view, c) -> int:
    """The collective's index among those its module issued in the step (stable across steps)."""
    same = [x for x in view.coll_list if x.module == c.module]
    return same.index(c)


def _reduced_before(view, c):
    """The earlier sum-reduction whose output, on every rank, is ``c``'s input."""
    ins = {p: c.ins[p][0] for p in view.procs}
    for prev in view.before(c.t0):
        if prev is c or not prev.sums or prev.op in REDUCE_SCATTER:
            continue
        outs = {p: prev.outs[p][0] for p in ins if prev.outs.get(p)}
        if len(outs) == len(ins) and linked(outs, ins) == 1.0:
            return prev
    return None


def _declared_tp_ranks(con) -> dict:
    out = {}
    for proc, tp_ranks in con.execute("SELECT proc, tp_ranks FROM processes WHERE tp_ranks IS NOT NULL"):
        try:
            out[proc] = list(json.loads(tp_ranks))
        except (TypeError, ValueError):
            pass
    return out


def _capture_findings(con, points) -> list:
    """Partial sums that reach a capture: a named capture point, or a source of a
    concatenation, that is a partial sum, or that differs across ranks and was built (its
    recorded ops) from a partial sum: the reduction came after the capture."""
    from tensor_trace.errors import TensorTraceError
    from tensor_trace.exporters.analysis import lineage as lin

    def lineage(name):
        try:
            return lin.lineage(con, name)
        except TensorTraceError:
            return None

    def partial_inside(name):
        """Why ``name`` holds a partial sum: itself, or a partial source of its lineage."""
        p = points.get(name)
        if p is None:
            return None
        if p["placement"] == "partial":
            hit = key_item(p["items"])
            return p, f"{name} is a partial sum ({p['reduction']})" + (f": {hit['text']}" if hit else "")
        if p["placement"] != "divergent":
            return None
        res = lineage(name)
        for s in (res or {}).get("sources", []):
            src = points.get(s["point"])
            if src is not None and src["placement"] == "partial":
                hit = key_item(src["items"])
                return src, (f"{name} differs across ranks and is {res['op']} of [{', '.join(x['point'] for x in res['sources'])}], "
                             f"of which {s['point']} is a partial sum" + (f" ({hit['text']})" if hit else ""))
        return None

    out, reported = [], set()
    for p in points.values():
        if not p["module"].startswith(CAPTURE_PREFIX):
            continue
        why = partial_inside(p["point"])
        if why is not None:
            reported.add(p["point"])
            out.append(finding("pre-reduction-capture", p["point"], why[0]["collective"],
                               f"the named capture point {p['point']} holds a partial sum: captured before the "
                               f"reduction that completes it", [why[1]]))
    try:
        candidates = lin.points_with_lineage(con)
    except TensorTraceError:
        candidates = []
    for name in candidates:
        res = lineage(name)
        if res is None or (res.get("op") or "").split("(")[0] not in _CONCAT_OPS:
            continue
        for i, s in enumerate(res["sources"]):
            why = partial_inside(s["point"])
            if why is None or s["point"] in reported:
                continue
            reported.add(s["point"])
            out.append(finding(
                "pre-reduction-capture", s["point"], why[0]["collective"],
                f"{name} = {res['op']} of {len(res['sources'])} tensors; source #{i}, {s['point']}, holds a partial "
                f"sum: captured before the reduction that completes it",
                [f"{name}: {res['op']} of [{', '.join(x['point'] for x in res['sources'])}]", why[1]]))
    return out


def _divergent_findings(points) -> list:
    out = []
    for p in points:
        if p["placement"] != "divergent":
            continue
        if (p["rule"] == "divergent" and p["collective"] is not None) or p["rule"] == "reduced-own-slice":
            continue  # per-rank by design: the input of a max all_reduce or a broadcast (rules.divergent),
            #           a rank's max or argmax over its own slice (rules_dataflow.derived_from_shard)
        if (p["collective"] or {}).get("op") == "reduce":
            continue  # a reduce delivers to its destination only: other ranks' buffers are undefined
        values = [i["text"] for i in p["items"] if i["kind"] in ("values", "shape")]
        out.append(finding("divergent", p["point"], p["collective"],
                           f"{p['point']} differs across the ranks of its TP group with no evidence of a "
                           f"partial sum, a gather or a shard", values[-2:]))
    return out


def _issue_findings(con) -> list:
    out = []
    for gid, seq, kind, ranks, detail, gname, granks in con.execute(
            "SELECT i.group_id, i.seq, i.kind, i.ranks, i.detail, g.name, g.ranks FROM collective_issues i "
            "JOIN groups g USING(group_id) ORDER BY i.group_id, i.seq"):
        module = con.execute("SELECT m.path, c.op FROM collectives c LEFT JOIN modules m USING(module_id) "
                             "WHERE c.group_id=? AND c.seq=? LIMIT 1", (gid, seq)).fetchone()
        coll = dict(op=module[1] if module else None, group=gname, group_ranks=json.loads(granks), seq=seq,
                    module=module[0] if module else None)
        out.append(finding(f"collective-{kind}", module[0] if module else None, coll, detail,
                           [f"ranks {json.loads(ranks)}", "matched across ranks by (group, sequence number)"]))
    return out


def _raised_findings(con) -> list:
    """``collective-error``: a collective that raised on some rank (its peer died, a timeout),
    with the ranks of its group that never issued it: where a rank's trace stops (a crashed
    TP worker), which alignment leaves out as a rank that was killed."""
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    last = {(g, p): s for g, p, s in con.execute("SELECT group_id, proc, MAX(seq) FROM collectives GROUP BY group_id, proc")}
    out = []
    for gid, seq, op, gname, granks, module in con.execute(
            "SELECT c.group_id, c.seq, c.op, g.name, g.ranks, m.path FROM collectives c JOIN groups g USING(group_id) "
            "LEFT JOIN modules m USING(module_id) WHERE (c.flags & ?) != 0 GROUP BY c.group_id, c.seq "
            "ORDER BY c.group_id, c.seq", (schema.FLAG_ERROR,)):
        rows = con.execute("SELECT proc, flags FROM collectives WHERE group_id=? AND seq=?", (gid, seq)).fetchall()
        raised = sorted(rank_of.get(p) for p, f in rows if f & schema.FLAG_ERROR)
        ranks = json.loads(granks)
        procs = {r: p for p, r in rank_of.items() if r in ranks}
        never = sorted(r for r, p in procs.items() if p not in {q for q, _ in rows})
        detail = f"{op} #{seq} of group {gname} {ranks} raised on ranks {raised}"
        if never:
            stops = "; ".join(f"rank {r} at #{last[(gid, procs[r])]}" if (gid, procs[r]) in last else f"rank {r} before any"
                              for r in never)
            detail += f"; ranks {never} never issued it (their collectives of the group stop: {stops})"
        out.append(finding("collective-error", module, dict(op=op, group=gname, group_ranks=ranks, seq=seq, module=module),
                           detail, [f"raised on ranks {raised}"] + ([f"not issued on ranks {never}"] if never else [])))
    return out

