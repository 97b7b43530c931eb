"""``tensor-trace report``: one self-contained HTML file to look at a trace rather than read it.

The page holds a summary, never the spans: the placement map (layers x point kinds, from the
store's ``points``), collectives per layer and op per step, ``check``'s findings, the comparison
with a second trace when given, and run facts (ranks, hosts, clock skew, tracer errors, dropped
data). Its size follows the model's points, not the trace's length. The page's CSS and script
are inline (``report.html`` next to this module): it opens with no network.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from importlib import resources

from tensor_trace import progress
from tensor_trace.exporters.formats import layer_map

_TEMPLATE = "report.html"
_DATA_MARK = "/*REPORT_DATA*/null"
_TITLE_MARK = "<!--REPORT_TITLE-->"
MAX_EVIDENCE = 12  # per point: the key items come first; a click shows these
MAX_LISTED = 200  # rows of findings, comparison points and errors kept in the page


def write_report(trace, out: str, other=None) -> dict:
    """Write ``trace``'s report (a ``tensor_trace.api.Trace``) to ``out``; ``other``: a second
    Trace to compare with. Returns ``{path, bytes, layers, points, findings}``."""
    data = build_report(trace, other)
    page = render(data)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)
    return dict(path=out, bytes=os.path.getsize(out), layers=sum(len(s["layers"]) for s in data["stacks"]),
                points=len(data["points"]), findings=len(data["findings"]),
                first_divergence=(data["compare"] or {}).get("first_divergence"))


def build_report(trace, other=None) -> dict:
    """The page's data (what the script draws): plain JSON-able objects."""
    with progress.task("report: placement map") as bar:
        points = trace.points()
        data = dict(title=os.path.basename(os.path.abspath(trace.dir)), dir=os.path.abspath(trace.dir),
                    generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        data.update(placement_map(points))
        bar.stage("report: collectives")
        data["collectives"] = collectives_by_layer(trace.collectives())
        bar.stage("report: check")
        data["findings"] = trace.check()[:MAX_LISTED]
        bar.stage("report: run facts")
        data["facts"] = run_facts(trace.con)
    data["compare"] = None
    if other is not None:
        res = trace.compare(other)
        data["compare"] = comparison(res, other.dir)
    return data


def placement_map(points: list) -> dict:
    """Stacks of layers with their columns, and every point's cell: ``[name, stack, layer,
    column, placement, reduction, shapes, dtype, evidence]`` (stack, layer and column null
    outside the layers)."""
    stacks, where, outside = layer_map.stacks([p["point"] for p in points])
    col_index = {s.path: {c: i for i, c in enumerate(s.columns)} for s in stacks}
    cells = []
    for p in points:
        stack, index, kind = where.get(p["point"], (None, None, None))
        ev = _key_first(p)[:MAX_EVIDENCE]
        cells.append(dict(point=p["point"], stack=stack, layer=index,
                          column=col_index[stack][kind] if stack is not None else None,
                          placement=p["placement"], reduction=p["reduction"], shapes=_shapes_text(p["shapes"]),
                          dtype=p.get("dtype") or "mixed", evidence=ev, rule=p.get("rule")))
    return dict(stacks=[dict(path=s.path, layers=s.indices, columns=[layer_map.column_label(c) for c in s.columns])
                        for s in stacks], points=cells, outside=len(outside))


def _key_first(p: dict) -> list:
    """The point's evidence strings, its key item first."""
    from tensor_trace.exporters.analysis.evidence import key_item

    ev = list(p["evidence"])
    hit = key_item(p.get("evidence_items") or [])
    if hit is not None and hit["text"] in ev:
        ev.remove(hit["text"])
        ev.insert(0, hit["text"])
    return ev


def _shapes_text(shapes: dict) -> str:
    vals = list(shapes.values())
    if vals and all(v == vals[0] for v in vals):
        return f"{vals[0]} x{len(vals)}"
    return " ".join(f"r{k}:{v}" for k, v in shapes.items())


def collectives_by_layer(rows: list) -> list:
    """``query collectives`` rows summed per (layer, op, group), per traced step of one rank:
    ``{layer, op, group, count, bytes, host_ms, device_ms, steps, modules}``."""
    agg: dict = {}
    for r in rows:
        key, _ = layer_map.layer_of(r["module"]) if r["module"] else (None, "")
        where = f"{key.stack}.{key.index}" if key else (r["module"] or "<root>")
        op = r["op"] + (f"({r['reduce_op']})" if r["reduce_op"] else "")
        a = agg.setdefault((where, op, r["group"]), dict(
            layer=where, op=op, group=f"{r['group']} {r['group_ranks']}", count=0, bytes=0, host_ms=0.0,
            device_ms=None, steps=max(1, len(r["per_step"])), modules=[]))
        steps = max(1, len(r["per_step"]))
        a["count"] += r["count"] / steps
        a["bytes"] += r["bytes"] / steps
        a["host_ms"] += r["time_ms"] / steps
        if r.get("device_time_ms") is not None:
            a["device_ms"] = (a["device_ms"] or 0.0) + r["device_time_ms"] / steps
        a["modules"].append(r["module"] or "<root>")
    out = list(agg.values())
    for a in out:
        a["count"] = round(a["count"], 2)
        a["bytes"] = round(a["bytes"])
        a["host_ms"] = round(a["host_ms"], 4)
        if a["device_ms"] is not None:
            a["device_ms"] = round(a["device_ms"], 4)
    return out


def run_facts(con) -> dict:
    """Ranks, hosts, clock skew, steps, spans, tracer errors and dropped data, from the store."""
    procs = [dict(proc=p, rank=r, host=h, pid=pid, world_size=ws, tp_size=tp, device=dev,
                  clock_offset_ms=round((off or 0) / 1e6, 3),
                  clock_skew_ms=None if res is None else round(res / 1e6, 3), clock_matches=n,
                  corrupt_chunks=cc or 0, skipped_bytes=sb or 0, truncated=bool(tr), end_reason=end)
             for p, r, h, pid, ws, tp, dev, off, res, n, cc, sb, tr, end in con.execute(
                 "SELECT proc, rank, host, pid, world_size, tp_size, device, clock_offset_ns, "
                 "clock_residual_ns, clock_matches, corrupt_chunks, skipped_bytes, truncated, end_reason "
                 "FROM processes ORDER BY rank IS NULL, rank, proc")]
    steps, step_rows, interrupted, spans, colls = con.execute(
        "SELECT COUNT(DISTINCT step), COUNT(*), COALESCE(SUM(interrupted), 0), COALESCE(SUM(n_spans), 0), "
        "COALESCE(SUM(n_collectives), 0) FROM steps").fetchone()
    errors = [dict(location=loc, message=msg, count=n) for loc, msg, n in con.execute(
        "SELECT location, message, COUNT(*) FROM errors GROUP BY location, message ORDER BY MIN(t) "
        f"LIMIT {MAX_LISTED}")]
    issues = [dict(kind=k, detail=d) for k, d in con.execute(
        f"SELECT kind, detail FROM collective_issues LIMIT {MAX_LISTED}")]
    meta = dict(con.execute("SELECT key, value FROM meta"))
    skews = [p["clock_skew_ms"] for p in procs if p["clock_skew_ms"] is not None]
    return dict(run_id=meta.get("run_id"), processes=procs, hosts=sorted({p["host"] or "?" for p in procs}),
                ranks=sorted(p["rank"] for p in procs if p["rank"] is not None), steps=steps,
                step_rows=step_rows, interrupted_steps=interrupted, spans=spans, collectives=colls,
                max_clock_skew_ms=max(skews) if skews else None,
                errors=errors, error_count=con.execute("SELECT COUNT(*) FROM errors").fetchone()[0],
                collective_issues=issues,
                dropped=dict(corrupt_chunks=sum(p["corrupt_chunks"] for p in procs),
                             skipped_bytes=sum(p["skipped_bytes"] for p in procs),
                             truncated_files=sum(p["truncated"] for p in procs),
                             killed=sum(1 for p in procs if p["end_reason"] is None)))


def comparison(res: dict, other_dir: str) -> dict:
    """What the page keeps of a ``compare`` result: its summary, every point's status, and
    the points that are not ``same`` (up to MAX_LISTED)."""
    counts: dict = {}
    for p in res["points"]:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    return dict(other=os.path.abspath(other_dir), first_divergence=res["first_divergence"],
                tolerance=res["tolerance"], counts=counts, steps=len(res.get("steps") or []),
                status={p["point"]: [p["status"], p["rel_error"]] for p in res["points"]},
                listed=[p for p in res["points"] if p["status"] != "same"][:MAX_LISTED])


def render(data: dict) -> str:
    """The HTML page: the template with ``data`` as a JSON literal for its script."""
    template = resources.files(__package__).joinpath(_TEMPLATE).read_text(encoding="utf-8")
    # No "<" in the literal, so that no "</script" or "<!--" inside a string ends the script early.
    literal = json.dumps(data, separators=(",", ":"), default=str).replace("<", "\\u003c")
    return (template.replace(_TITLE_MARK, html.escape(f"tensor-trace report: {data['title']}"))
            .replace(_DATA_MARK, literal))
