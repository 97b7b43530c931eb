"""The one-screen summary printed at the end of ``tensor-trace record``."""

from __future__ import annotations

import collections
import os

from tensor_trace.errors import BadInput
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


def summarize(trace_dir: str) -> dict:
    """Counts over every rank file of a trace folder."""
    files = rank_files(trace_dir)
    out = dict(dir=os.path.abspath(trace_dir), processes=0, ranks=[], spans=0, collectives=0,
               steps=0, fingerprinted_steps=0, fingerprint_schedule=None, bytes=0, errors=0, write_errors=0, graph_replays=0, graph_replays_untraced=0, live_sent=0, live_dropped=0, live=False,
               problems=[], per_rank=[])
    for path in files:
        try:
            rt = load_rank_file(path)
        except BadInput as exc:
            out["problems"].append(str(exc))
            continue
        out["processes"] += 1
        spans = sum(len(s.spans) for s in rt.steps.values())
        colls = sum(len(s.collectives) for s in rt.steps.values())
        ops = collections.Counter(c.op for s in rt.steps.values() for c in s.collectives)
        size = os.path.getsize(path)
        out["spans"] += spans
        out["collectives"] += colls
        out["bytes"] += size
        out["errors"] += len(rt.errors)
        end_stats = (rt.end or {}).get("stats") or {}
        out["graph_replays"] += end_stats.get("graph_replays", 0)
        out["write_errors"] += end_stats.get("write_errors", 0)
        out["graph_replays_untraced"] += end_stats.get("graph_replays_untraced", 0)
        if "live_otlp_sent" in end_stats:
            out["live"] = True
            out["live_sent"] += end_stats["live_otlp_sent"]
            out["live_dropped"] += end_stats["live_otlp_dropped"]
        if len(rt.steps) >= out["steps"]:
            out["fingerprinted_steps"] = sum(1 for st in rt.steps.values() if st.fingerprinted)
        out["steps"] = max(out["steps"], len(rt.steps))
        out["fingerprint_schedule"] = out["fingerprint_schedule"] or fingerprint_schedule(rt.header)
        if rt.rank is not None:
            out["ranks"].append(rt.rank)
        out["problems"] += [f"{os.path.basename(path)}: {p}" for p in rt.report.problems()]
        out["per_rank"].append(dict(rank=rt.rank, pid=rt.header.get("pid"), host=rt.header.get("host"),
                                    steps=len(rt.steps), spans=spans, collectives=dict(ops), bytes=size,
                                    errors=len(rt.errors), file=os.path.basename(path)))
    out["ranks"].sort()
    return out


def fingerprint_schedule(header: dict) -> str | None:
    """The recording's fingerprint schedule in words, from a rank file's header (None: not said)."""
    cfg = header.get("config") or {}
    if not cfg:
        return None
    if not cfg.get("fingerprint", True):
        return "off (--no-fingerprint)"
    every, first = cfg.get("fingerprint_every"), cfg.get("fingerprint_first")
    if every is None or every <= 1:
        return "every traced step"
    return f"first {first} steps of each kind, then every {_ordinal(every)} (--fingerprint-every 1 for all)"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def format_summary(s: dict) -> str:
    lines = [f"tensor-trace: {len(s['ranks'])} rank(s) in {s['processes']} traced process(es), "
             f"{s['steps']} step(s), {s['spans']} module spans, {s['collectives']} collectives, "
             f"{s['bytes']:,} bytes, {s['errors']} tracer error(s)"]
    if s["spans"]:
        lines[0] += f" ({s['bytes'] / max(1, s['spans'] + s['collectives']):.0f} bytes/span)"
    for r in sorted(s["per_rank"], key=lambda r: (r["rank"] is None, r["rank"] or 0))[:16]:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "no collectives"
        lines.append(f"  rank {r['rank'] if r['rank'] is not None else '?':>3}  pid {r['pid']:<7} "
                     f"{r['steps']:>4} steps {r['spans']:>7} spans  {ops}")
    if len(s["per_rank"]) > 16:
        lines.append(f"  ... and {len(s['per_rank']) - 16} more")
    if s["fingerprint_schedule"]:
        lines.append(f"  fingerprints: {s['fingerprint_schedule']}; {s['fingerprinted_steps']} of "
                     f"{s['steps']} step(s) fingerprinted")
    if s["live"]:
        lines.append(f"  live OTLP: {s['live_sent']} spans sent, {s['live_dropped']} dropped")
    if s["graph_replays"]:
        lines.append(f"  {s['graph_replays']} CUDA-graph replay(s) traced as steps (values from the graph's "
                     f"own fingerprint kernels)")
    if s["graph_replays_untraced"]:
        lines.append(f"  {s['graph_replays_untraced']} replay(s) of CUDA graphs captured without tracing: "
                     f"counted only (keep the capture inside the traced steps)")
    if s["write_errors"]:
        lines.append(f"  warning: {s['write_errors']} write(s) of the trace failed (disk full?): "
                     f"the records they held are missing")
    for p in s["problems"][:5]:
        lines.append(f"  warning: {p}")
    lines.append(f"  files: {s['dir']}")
    return "\n".join(lines)
