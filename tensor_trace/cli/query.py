"""tensor-trace query placement|reduction|collectives|shapes|lineage|diff|steps|sql"""

from __future__ import annotations

import click

from tensor_trace.cli.options import json_option, open_trace, trace_option
from tensor_trace.cli.table import echo_json, echo_table, fmt_shapes
from tensor_trace.format.points import is_input

@click.group()
def query():
    """Ask a recorded trace questions."""


@query.command()
@click.argument("pattern", required=False)
@trace_option
@click.option("--step", type=int, default=None, help="Judge from this step only.")
@json_option
def placement(pattern, trace_dir, step, as_json):
    """Placement and reduction of the points matching PATTERN (a glob; default: all outputs)."""
    pts = open_trace(trace_dir).points(pattern, step)
    if as_json:
        return echo_json(pts)
    echo_table(["point", "placement", "reduction", "shape", "dtype", "evidence"],
               [[p["point"], _placement_text(p), p["reduction"], fmt_shapes(p["shapes"]), p.get("dtype") or "mixed",
                 _key_evidence(p)] for p in pts])


def _placement_text(p: dict) -> str:
    """The placement, and where the point's data is split across groups (DP attention's tokens)
    the split: ``replicate, split(attn_dp, dim 0)``."""
    split = p.get("data_split")
    if not split:
        return p["placement"]
    return f"{p['placement']}, split({split['over']}, dim {split['dim']})"


def _key_evidence(p: dict) -> str:
    from tensor_trace.exporters.analysis.evidence import key_item

    hit = key_item(p.get("evidence_items") or [])
    if hit is not None:
        return hit["text"]
    ev = p["evidence"]
    return ev[0] if ev else ""


@query.command()
@click.argument("point")
@trace_option
@json_option
def reduction(point, trace_dir, as_json):
    """Is POINT pre- or post-reduction, and which collective completes or produced it?"""
    r = open_trace(trace_dir).reduction(point)
    if as_json:
        return echo_json(r)
    click.echo(f"{r['point']}: {r['verdict']} ({_placement_text(r)})")
    c = r["collective"]
    if c:
        click.echo(f"  collective: {c['op']}{'(' + c['reduce_op'] + ')' if c['reduce_op'] else ''} #{c['seq']} "
                   f"group {c['group']} ranks {c['group_ranks']}, {c['shape']} {c['dtype']}, {c['bytes']} bytes, "
                   f"issued by {c['module'] or '<root>'}")
    for e in r["evidence"]:
        click.echo(f"  - {e}")


@query.command()
@click.argument("pattern", required=False)
@trace_option
@json_option
def collectives(pattern, trace_dir, as_json):
    """Collectives per issuing module (PATTERN: a glob over module paths)."""
    rows = open_trace(trace_dir).collectives(pattern)
    if as_json:
        return echo_json(rows)
    timed = any(r["device_time_ms"] is not None for r in rows)
    echo_table(["module", "op", "group", "count", "per step", "bytes", "host ms"]
               + (["device ms"] if timed else []),
               [[r["module"] or "<root>", r["op"] + (f"({r['reduce_op']})" if r["reduce_op"] else ""),
                 f"{r['group']} {r['group_ranks']}", r["count"], _per_step(r["per_step"]), r["bytes"],
                 r["time_ms"]] + ([r["device_time_ms"] if r["device_time_ms"] is not None else "-"]
                                  if timed else []) for r in rows])


def _per_step(per_step: dict) -> str:
    vals = set(per_step.values())
    return f"{vals.pop()} x{len(per_step)} steps" if len(vals) == 1 else ",".join(map(str, per_step.values()))


@query.command()
@click.argument("point")
@trace_option
@json_option
def shapes(point, trace_dir, as_json):
    """Shapes and dtypes of POINT on every rank (a glob is allowed)."""
    rows = open_trace(trace_dir).shapes(point)
    if as_json:
        return echo_json(rows)
    echo_table(["point", "shapes", "dtype", "steps"],
               [[r["point"], _shapes_text(r), r.get("dtype") or r.get("dtypes"), r["steps"]] for r in rows])


def _shapes_text(r) -> str:
    """One step's shapes on every rank, or, where the point's shape changed from step to step
    (prefill, then decode), each local shape of the first rank with the steps it had."""
    if not r.get("variants"):
        return fmt_shapes(r["shapes"])
    return "; ".join(f"{v['shape']} in {v['steps']} step{'s' if v['steps'] != 1 else ''} "
                     f"(from step {v['first_step']})" for v in r["variants"])


@query.command()
@click.argument("point")
@trace_option
@json_option
def lineage(point, trace_dir, as_json):
    """What POINT's tensor was built from: the ordered sources and the op that combined them."""
    res = open_trace(trace_dir).lineage(point)
    if as_json:
        return echo_json(res)
    echo_lineage(res)


def echo_lineage(res) -> None:
    _echo_lineage_of(res)
    for other in res.get("ranks_differ") or ():
        built = (f"{other['op']} of [{', '.join(s['point'] for s in other['sources'])}]" if other["sources"]
                 else "no recorded op")
        click.echo(f"RANKS DIFFER: rank {other['rank']} built it from {built}")


def _echo_lineage_of(res) -> None:
    head = f"{res['point']} {fmt_shapes(res['shapes'])} {res['dtype'] or ''} {res['placement']}".rstrip()
    if not res["sources"]:
        where = ("made before the call by code whose ops were not recorded (a hook, a leaf module's body, "
                 "a collective)" if is_input(res["point"].rsplit(":", 1)[-1]) else "computed inside its module")
        click.echo(f"{head}: no recorded op built it ({where})")
        return
    via = f" <- {' <- '.join(res['via'])}" if res.get("via") else ""
    inside = f" (inside {', '.join(res['inside'])})" if res.get("inside") else ""
    click.echo(f"{head} = {res['op']}{inside}{via} of:")

    def path(s):
        parts = [" <- ".join(s.get("via") or [])] + [f"inside {p}" for p in s.get("inside") or []]
        return ", ".join(p for p in parts if p) or "-"

    def captured(s):
        c = s.get("captured")
        if not c:
            return "-"
        pts = c["points"]
        text = pts[0] if c["op"] == "identity" and len(pts) == 1 else f"{c['op']} of [{', '.join(pts)}]"
        return f"{text} ({c['what']})" if c.get("what") else text

    header = ["#", "source", "op", "shape", "placement", "via"]
    rows = [[i, s["point"], s["op"], fmt_shapes(s["shapes"]) if s["shapes"] else "-", s["placement"], path(s)]
            for i, s in enumerate(res["sources"])]
    if any(s.get("captured") for s in res["sources"]):  # named capture points: what each was handed
        header.append("captured")
        for row, s in zip(rows, res["sources"]):
            row.append(captured(s))
    echo_table(header, rows)


@query.command()
@click.argument("dir_a")
@click.argument("dir_b")
@json_option
def diff(dir_a, dir_b, as_json):
    """What changed between two traces: points added, removed, or changed."""
    d = open_trace(dir_a).diff(dir_b)
    if as_json:
        return echo_json(d)
    for p in d["added"]:
        click.echo(f"+ {p['point']}  {fmt_shapes(p['shapes'])} {p['placement']}")
    for p in d["removed"]:
        click.echo(f"- {p['point']}  {fmt_shapes(p['shapes'])} {p['placement']}")
    for p in d["changed"]:
        for f in p["fields"]:
            click.echo(f"~ {p['point']}  {f['field']}: {f['a']} -> {f['b']}")
            for m in f.get("mismatches", []):
                click.echo(f"    {m}")
    if not any(d.values()):
        click.echo("no differences")


@query.command()
@trace_option
@click.option("--where", "where", multiple=True, metavar="KEY=VALUE",
              help="Keep steps whose attr KEY is VALUE (repeatable), e.g. forward_mode=target_verify, draft=true.")
@json_option
def steps(trace_dir, where, as_json):
    """Traced steps and their attrs (forward mode, batch size, tokens, model, draft), and whether
    each took fingerprints."""
    from tensor_trace.errors import BadInput
    from tensor_trace.exporters import query as q

    cond = {}
    for item in where:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise BadInput(f"--where {item!r}: expected KEY=VALUE")
        cond[key] = value
    rows = open_trace(trace_dir).steps(cond)
    if as_json:
        return echo_json(rows)
    echo_table(["rank", "step", "root", "attrs", "spans", "collectives", "fingerprinted"],
               [[r["rank"] if r["rank"] is not None else f"proc {r['proc']}", r["step"], r["root"],
                 " ".join(f"{k}={q.attr_text(v)}" for k, v in sorted(r["attrs"].items())), r["spans"],
                 r["collectives"], {True: "yes", False: "no"}.get(r["fingerprinted"], "unknown")] for r in rows])


@query.command()
@click.argument("text")
@trace_option
@json_option
def sql(text, trace_dir, as_json):
    """Run SQL over the merged store (schema: docs/store-schema.md)."""
    r = open_trace(trace_dir).sql(text)
    if as_json:
        return echo_json(r)
    echo_table(r.columns, r.values)
