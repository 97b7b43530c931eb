"""Answers over a merged store: placement, reduction, collectives, shapes, diff, sql.

Each function takes an open store (``pipeline.open_store``) and returns plain JSON-able data with
the keys of the contract (shared/design.md); the CLI formats it. ``NoAnswer`` (exit 1) carries
the nearest point names when a point is unknown.
"""

from __future__ import annotations

import json
import sqlite3

from tensor_trace.errors import BadInput, NoAnswer
from tensor_trace.exporters.store.points import capture_info, find_point, match_points, nearest_names
from tensor_trace.format.points import CAPTURE_PREFIX, module_matches, point_name


def placement(con, pattern: str | None, step: int | None = None) -> list[dict]:
    if step is not None:
        return _placement_at_step(con, pattern, step)
    pts = match_points(con, pattern)
    if not pts:
        raise NoAnswer(f"no point matches {pattern!r}; nearest: {nearest_names(con, pattern or '')}")
    return _with_capture_info(con, pts)


def _with_capture_info(con, pts: list) -> list:
    for p in pts:
        if p["module"].startswith(CAPTURE_PREFIX):
            p["capture"] = capture_info(con, p["module"])
    return pts


def _placement_at_step(con, pattern, step) -> list[dict]:
    from tensor_trace.exporters.analysis.evidence import item, texts
    from tensor_trace.exporters.analysis import groups
    from tensor_trace.exporters.analysis.verdicts import StoreContext, tp_groups_with_size, unfingerprinted_note

    if not con.execute("SELECT 1 FROM steps WHERE step=? LIMIT 1", (step,)).fetchone():
        raise NoAnswer(f"step {step} was not traced; traced steps: " + ", ".join(
            str(s) for (s,) in con.execute("SELECT DISTINCT step FROM steps ORDER BY step LIMIT 20")))
    ctx = StoreContext(con)
    out = []
    multi = {r[0] for r in con.execute("SELECT DISTINCT module FROM points WHERE call > 0")}
    for procs, size in tp_groups_with_size(con):
        view, verdicts = ctx.judge_step(con, step, procs, size, groups.dp_subgroups(con, procs, ctx.rank_of))
        note = unfingerprinted_note(con, procs, step)
        for key in sorted(verdicts, key=lambda k: view.times.get(k, (1 << 62, 0, 0))):
            module, call, slot = key
            v = verdicts[key]
            items = ([item("sampling", note, step=step)] if note else []) + v["items"]
            name = point_name(module, call, slot, module in multi or view.max_call[module] > 0)
            dtypes = set(v["dtypes"].values())
            out.append(dict(point=name, module=module, call=call, slot=slot, placement=v["placement"],
                            reduction=v["reduction"], rule=v["rule"], shapes=v["shapes"],
                            dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
                            evidence=texts(items) + [f"step {step}"], evidence_items=items,
                            collective=v["collective"], steps=1, fingerprint=v["fp"],
                            **(dict(group=v["group"], data_split=v.get("data_split")) if v.get("group") else {})))
    if pattern:
        keep = {p["point"] for p in match_points(con, pattern)}
        out = [p for p in out if p["point"] in keep]
    if not out:
        raise NoAnswer(f"no point matches {pattern!r} in step {step}")
    _against_all_steps(con, step, out)
    return out


def _against_all_steps(con, step, out) -> None:
    """In a step whose ops were not recorded (lineage is taken on a schedule), a verdict that
    rests on a guess along the dataflow can differ from the one of all steps, which steps with
    recorded ops decided: say so beside it (one decode step's one head and one token read a
    shard along the wrong size-1 dim)."""
    if con.execute("SELECT 1 FROM lineage WHERE step=? LIMIT 1", (step,)).fetchone():
        return
    overall: dict = {}
    rule_of: dict = {}
    for p in match_points(con, "*:*"):
        overall.setdefault(p["point"], []).append((p["placement"], p["reduction"]))
        rule_of[p["point"]] = p["rule"]
    for p in out:
        seen = overall.get(p["point"]) or []
        mine = (p["placement"], p["reduction"])
        if len(seen) != 1 or seen[0] == mine or seen[0][0] == "unknown":
            continue
        placed_by_ops = rule_of.get(p["point"]) in _OPS_PLACED and (seen[0][0].startswith("shard(")
                                                                     or seen[0][0] == "partial")
        if p["rule"] == "divergent" and placed_by_ops:
            # values that differ are what a shard predicts; without ops this step cannot place
            # them (verdicts.vote does not count such a step against the ones with ops)
            note = (f"this step has no evidence of a shard: its ops were not recorded (lineage is taken on a "
                    f"schedule); the steps whose ops were recorded place it {seen[0][0]}/{seen[0][1]}, taken here "
                    "(record with --lineage-every 1 to have ops in every step)")
            p["placement"], p["reduction"] = seen[0]
        elif (p["rule"] in _GUESSED_DIM and mine[0].startswith("shard(") and seen[0][0].startswith("shard(")
                and mine[1] == seen[0][1]):
            # only the dim differs, and this step guessed it (a shard derived from the latest one
            # before it, without the reshapes between them): the steps with ops place it
            note = (f"this step guessed {mine[0]} along the dataflow (its ops were not recorded: lineage is taken "
                    f"on a schedule); the steps whose ops were recorded place it {seen[0][0]}, taken here "
                    "(record with --lineage-every 1 to have ops in every step)")
            p["placement"] = seen[0][0]
        else:
            note = (f"all steps together: {seen[0][0]}/{seen[0][1]}, from steps whose ops were recorded; this "
                    f"step's ops were not (lineage is taken on a schedule: record with --lineage-every 1 to have "
                    f"them in every step)")
        p["evidence"].insert(len(p["evidence"]) - 1, note)
        p["evidence_items"].append(dict(kind="sampling", text=note, refs={}))


# rules that follow the dataflow without recorded ops: a shard's dim among size-1 dims is a guess
_GUESSED_DIM = frozenset(("derived-from-shard", "same-values"))
# rules of the verdicts of all steps that rest on recorded ops (verdicts._OPS_RULES)
_OPS_PLACED = frozenset(("lineage-ops", "derived-from-shard", "same-values"))


def reduction(con, point: str) -> dict:
    pts = find_point(con, point)
    p = pts[0]
    out = dict(point=p["point"], verdict=p["reduction"], placement=p["placement"], rule=p.get("rule"),
               collective=p["collective"], evidence=p["evidence"], evidence_items=p.get("evidence_items", []))
    if "group" in p:
        out.update(group=p["group"], data_split=p["data_split"])
    return out


def shapes(con, point: str) -> list[dict]:
    if any(ch in point for ch in "*?["):
        pts = match_points(con, point)
        if not pts:
            raise NoAnswer(f"no point matches {point!r}; nearest: {nearest_names(con, point)}")
    else:
        pts = find_point(con, point)
    variants = _shape_variants(con, pts)
    out = []
    for p in pts:
        d = dict(point=p["point"], module=p["module"], call=p["call"], shapes=p["shapes"], steps=p["steps"])
        v = variants.get((p["module"], p["call"], p["slot"]))
        if v is not None:
            # the steps that held this slot (a mask passed in prefill only, None in decode),
            # not every step of its module's call
            d["steps"] = sum(x["steps"] for x in v)
            if len(v) > 1:
                d["variants"] = v
        if "dtypes" in p:
            d["dtypes"] = p["dtypes"]
        else:
            d["dtype"] = p["dtype"]
        if p["module"].startswith(CAPTURE_PREFIX):
            d["capture"] = capture_info(con, p["module"])
        out.append(d)
    return out


def _shape_variants(con, pts) -> dict:
    """(module, call, slot) -> [{shape, steps, first_step}] of the first traced process, one per
    local shape the point had over all its steps, in the order first seen (a prefill step's
    ``[1, 6]`` then decode steps' ``[1, 1]``): ``shapes`` alone is one step's."""
    ids = {path: mid for mid, path in con.execute("SELECT module_id, path FROM modules")}
    wanted = {(ids.get(p["module"]), p["call"]) for p in pts if ids.get(p["module"]) is not None}
    if not wanted:
        return {}
    bounds = con.execute("SELECT MIN(span_first), MAX(span_last) FROM steps WHERE proc = "
                         "(SELECT MIN(proc) FROM steps WHERE span_first IS NOT NULL)").fetchone()
    if bounds is None or bounds[0] is None:
        return {}
    mids = sorted({m for m, _ in wanted})
    rows = con.execute(f"SELECT module_id, call, layout_id, COUNT(DISTINCT step), MIN(step) FROM spans "
                       f"WHERE rowid BETWEEN ? AND ? AND module_id IN ({','.join('?' * len(mids))}) "
                       "GROUP BY module_id, call, layout_id", (*bounds, *mids)).fetchall()
    layouts = {}
    paths = {mid: path for path, mid in ids.items()}
    out: dict = {}
    for mid, call, lay, n, first in rows:
        if (mid, call) not in wanted:
            continue
        if lay not in layouts:
            got = con.execute("SELECT slots FROM layouts WHERE layout_id=?", (lay,)).fetchone()
            layouts[lay] = json.loads(got[0]) if got else []
        for slot in layouts[lay]:
            per = out.setdefault((paths[mid], call, slot[0]), {})
            shape = tuple(slot[1])
            steps, at = per.get(shape, (0, first))
            per[shape] = (steps + n, min(at, first))
    return {key: [dict(shape=list(shape), steps=n, first_step=at)
                  for shape, (n, at) in sorted(per.items(), key=lambda kv: kv[1][1])]
            for key, per in out.items()}


def collectives(con, pattern: str | None) -> list[dict]:
    """Per issuing module: op, reduce op, group, count, bytes and time per rank, per step.

    Counts and bytes are those of one rank (the lowest that issued it); ``time_ms`` is the mean
    over the ranks of the host time spent in the calls, ``device_time_ms`` the same for the
    device time between CUDA events (None where no call was timed on a device)."""
    order_of = {p: i for i, (p,) in enumerate(con.execute(
        "SELECT proc FROM processes ORDER BY rank IS NULL, rank, proc"))}
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    groups = {gid: (name, ranks) for gid, name, ranks in con.execute("SELECT group_id, name, ranks FROM groups")}
    agg: dict = {}
    for mid, op, redop, gid, proc, n, nbytes, dur, per_step, first, dev, dev_n in con.execute(
            "SELECT module_id, op, reduce_op, group_id, proc, count, bytes, dur_ns, per_step, first, "
            "device_ns, device_count FROM collective_summary"):
        module = modules.get(mid, "") if mid is not None else ""
        if pattern and not module_matches(pattern, module):
            continue
        a = agg.setdefault((mid, op, redop, gid), dict(module=module, procs={}, first=first))
        a["procs"][proc] = (n, nbytes, dur, per_step)
        if dev_n:
            a.setdefault("device", []).append(dev)
        a["first"] = min(a["first"], first)
    out = []
    for (mid, op, redop, gid), a in sorted(agg.items(), key=lambda kv: (kv[1]["first"], kv[0][1])):
        ref = min(a["procs"], key=lambda p: order_of.get(p, 1 << 30))
        n, nbytes, _, per_step = a["procs"][ref]
        gname, granks = groups[gid]
        times = [t for _, _, t, _ in a["procs"].values()]
        dev = a.get("device")
        out.append(dict(module=a["module"], op=op, reduce_op=redop, group=gname, group_ranks=json.loads(granks),
                        count=n, bytes=nbytes, time_ms=round(sum(times) / len(times) / 1e6, 3),
                        device_time_ms=round(sum(dev) / len(dev) / 1e6, 3) if dev else None,
                        per_step=dict(json.loads(per_step)), ranks=len(a["procs"])))
    if not out and pattern:
        raise NoAnswer(f"no collective issued by a module matching {pattern!r}")
    return out


def diff(con_a, con_b) -> dict:
    """Points added, removed or changed (shape, dtype, placement, reduction, collectives)."""
    def load(con):
        return {p["point"]: p for p in match_points(con, "*:*")}

    a, b = load(con_a), load(con_b)
    added = [dict(point=n, shapes=b[n]["shapes"], placement=b[n]["placement"]) for n in b if n not in a]
    removed = [dict(point=n, shapes=a[n]["shapes"], placement=a[n]["placement"]) for n in a if n not in b]
    changed = []
    for n in a:
        if n not in b:
            continue
        fields = []
        for f in ("shapes", "dtype", "placement", "reduction"):
            if a[n].get(f) != b[n].get(f):
                fields.append(dict(field=f, a=a[n].get(f), b=b[n].get(f)))
        if not fields and not _same_values(a[n], b[n]):
            fields.append(dict(field="values", a=_fp_text(a[n]), b=_fp_text(b[n])))
        if fields:
            changed.append(dict(point=n, fields=fields))
    ca, cb = _calls_per_step(con_a), _calls_per_step(con_b)
    for key in sorted(set(ca) | set(cb), key=str):
        x, y = ca.get(key, 0), cb.get(key, 0)
        if x != y:
            changed.append(dict(point=f"collectives:{key[0] or '<root>'}:{key[1]}", fields=[
                dict(field="count_per_step", a=x, b=y)]))
    from tensor_trace.exporters.analysis import lineage as lin

    for name in sorted(set(lin.points_with_lineage(con_a)) | set(lin.points_with_lineage(con_b))):
        if name not in a or name not in b:
            continue
        la, lb = lin.lineage(con_a, name), lin.lineage(con_b, name)
        problems = lin.compare(la, lb)
        if problems:
            entry = next((c for c in changed if c["point"] == name), None)
            if entry is None:
                entry = dict(point=name, fields=[])
                changed.append(entry)
            entry["fields"].append(dict(field="lineage", a=[s["point"] for s in la["sources"]],
                                        b=[s["point"] for s in lb["sources"]],
                                        mismatches=[m["message"] for m in problems]))
    return dict(added=added, removed=removed, changed=changed)


def _calls_per_step(con) -> dict:
    """(module, op, reduce op, group name) -> calls per step that issued it, of the lowest rank,
    as ``collectives`` gives them (its ``count`` over its ``per_step``'s length), without
    decoding every step's count (SQLite counts them)."""
    order_of = {p: i for i, (p,) in enumerate(con.execute(
        "SELECT proc FROM processes ORDER BY rank IS NULL, rank, proc"))}
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    names = dict(con.execute("SELECT group_id, name FROM groups"))
    try:
        rows = con.execute("SELECT module_id, op, reduce_op, group_id, proc, count, json_array_length(per_step), "
                           "first FROM collective_summary").fetchall()
    except sqlite3.OperationalError:  # an SQLite without JSON functions
        rows = [(*r[:6], len(json.loads(r[6])), r[7]) for r in con.execute(
            "SELECT module_id, op, reduce_op, group_id, proc, count, per_step, first FROM collective_summary")]
    agg: dict = {}
    for mid, op, redop, gid, proc, n, n_steps, first in rows:
        a = agg.setdefault((mid, op, redop, gid), dict(procs={}, first=first))
        a["procs"][proc] = (n, n_steps)
        a["first"] = min(a["first"], first)
    out = {}
    for (mid, op, redop, gid), a in sorted(agg.items(), key=lambda kv: (kv[1]["first"], kv[0][1])):
        n, n_steps = a["procs"][min(a["procs"], key=lambda p: order_of.get(p, 1 << 30))]
        module = modules.get(mid, "") if mid is not None else ""
        out[(module, op, redop, names[gid])] = round(n / max(n_steps, 1), 3)
    return out


def _same_values(x: dict, y: dict) -> bool:
    """Same fingerprint on the lowest rank in the first sampled step (within the dtype's
    tolerance); unknown counts as the same. Meaningful when both runs had the same inputs."""
    from tensor_trace.exporters.analysis.tolerance import Observed as T, fp_equal

    if not x.get("fingerprint") or not y.get("fingerprint"):
        return True
    shape = next(iter(x["shapes"].values()))
    return fp_equal(T(shape, x.get("dtype") or "bfloat16", tuple(x["fingerprint"])),
                    T(shape, y.get("dtype") or "bfloat16", tuple(y["fingerprint"])))


def _fp_text(p: dict) -> str:
    fp = p.get("fingerprint")
    return f"sum {fp[0]:.6g}, sumsq {fp[1]:.6g}" if fp and fp[1] is not None else str(fp)


def steps(con, where: dict | None = None) -> list[dict]:
    """Traced steps, one row per process and step, with their attrs (forward mode, batch size,
    tokens, and for SGLang the model that ran and ``draft`` for an EAGLE draft worker's
    forward) and whether each took fingerprints (``record --fingerprint-every``; None where its
    step record was lost, as analysis reads it: not known to hold values), keeping those
    whose attrs equal every ``where`` item; a value is matched as its text, so ``draft=true``
    and ``batch_size=1`` match JSON true and 1."""
    where = where or {}
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    out = []
    for proc, step, root, attrs, n_spans, n_coll, interrupted, fingerprinted in con.execute(
            "SELECT proc, step, root, attrs, n_spans, n_collectives, interrupted, fingerprinted "
            "FROM steps ORDER BY proc, step"):
        a = json.loads(attrs) if attrs else {}
        if any(attr_text(a.get(k)) != v for k, v in where.items()):
            continue
        out.append(dict(proc=proc, rank=rank_of.get(proc), step=step, root=root, attrs=a, spans=n_spans,
                        collectives=n_coll, interrupted=bool(interrupted),
                        fingerprinted=None if fingerprinted is None else bool(fingerprinted)))
    return out


def attr_text(value) -> str | None:
    """A step attr as ``query steps`` shows it and ``--where`` matches it (JSON true as ``true``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def sql(con, text: str) -> dict:
    try:
        cur = con.execute(text)
    except sqlite3.Error as exc:
        raise BadInput(f"SQL error: {exc}")
    cols = [d[0] for d in cur.description or []]
    return dict(columns=cols, rows=[list(r) for r in cur.fetchall()])
