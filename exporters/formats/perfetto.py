"""Chrome trace-event JSON (opens in Perfetto UI and chrome://tracing), written as a stream.

One process per rank (named with rank, TP rank, host and pid), three tracks in each: steps,
module spans (complete events, nested by time), and collectives, with flow events joining the
same collective (group, sequence number) across ranks. Timestamps are microseconds on the
merge's aligned clock, from the earliest step. Events are produced from SQL cursors and written
one at a time: nothing holds the whole trace.
"""

from __future__ import annotations

import gzip
import json
import os

from tensor_trace import progress, schema
from tensor_trace.exporters.formats.base import ExportResult, SpanExporter
from tensor_trace.exporters.pipeline import open_store
from tensor_trace.format.points import OUTPUTS_SQL

TID_STEPS, TID_MODULES, TID_COLLECTIVES = 0, 1, 2
_dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode


class PerfettoExporter(SpanExporter):
    """Writes trace events to ``path`` (gzip when it ends in ``.gz``)."""

    def __init__(self, path: str):
        self.path = path
        opener = gzip.open if path.endswith(".gz") else open
        self._f = opener(path, "wt", encoding="utf-8")
        self._f.write('{"displayTimeUnit":"ns","traceEvents":[\n')
        self._first = True
        self.events = 0

    def export(self, batch) -> ExportResult:
        write = self._f.write
        for event in batch:
            if self._first:
                self._first = False
            else:
                write(",\n")
            write(_dumps(event))
            self.events += 1
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self._f.flush()
        return True

    def shutdown(self) -> None:
        if not self._f.closed:
            self._f.write("\n]}\n")
            self._f.close()


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def timeline_events(con):
    """Every trace event of a merged store, in a streaming order (processes, then per table)."""
    from tensor_trace.exporters.analysis import inferred_tp_ranks

    tp_of = inferred_tp_ranks(con)
    procs = {}
    for proc, rank, tp_rank, host, pid, offset in con.execute(
            "SELECT proc, rank, tp_rank, host, pid, COALESCE(clock_offset_ns, 0) FROM processes ORDER BY proc"):
        procs[proc] = dict(pid=rank if rank is not None else 100000 + proc, rank=rank, offset=offset)
        label = f"rank {rank}" if rank is not None else f"process {proc}"
        tp_rank = tp_of.get(proc, tp_rank)
        if tp_rank is not None:
            label += f" (tp {tp_rank})"
        p = procs[proc]["pid"]
        yield dict(ph="M", pid=p, name="process_name", args=dict(name=f"{label} {host}:{pid}"))
        yield dict(ph="M", pid=p, name="process_sort_index", args=dict(sort_index=p))
        for tid, name in ((TID_STEPS, "steps"), (TID_MODULES, "modules"), (TID_COLLECTIVES, "collectives")):
            yield dict(ph="M", pid=p, tid=tid, name="thread_name", args=dict(name=name))
    step_start = {}
    origin = None
    for proc, step, t_begin, t_end, attrs in con.execute(
            "SELECT proc, step, t_begin, t_end, attrs FROM steps WHERE t_begin IS NOT NULL ORDER BY proc, step"):
        t = t_begin + procs[proc]["offset"]
        step_start[(proc, step)] = t
        origin = t if origin is None else min(origin, t)
    if origin is None:
        return
    for proc, step, t_begin, t_end, attrs, dev in con.execute(
            "SELECT proc, step, t_begin, t_end, attrs, device_ns FROM steps WHERE t_begin IS NOT NULL "
            "ORDER BY proc, step"):
        a = json.loads(attrs or "{}")
        if dev is not None:
            a["device_us"] = _us(dev)
        name = (f"step {step}" + (f" {a['forward_mode']}" if a.get("forward_mode") else "")
                + (f" (replay of {a['replay_of']})" if a.get("replay_of") is not None else ""))
        t = step_start[(proc, step)]
        dur = (t_end - t_begin) if t_end is not None else 0
        yield dict(ph="X", pid=procs[proc]["pid"], tid=TID_STEPS, name=name, ts=_us(t - origin), dur=_us(dur),
                   args=a)
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    layouts: dict = {}

    def layout_args(lid):
        hit = layouts.get(lid)
        if hit is None:
            row = con.execute("SELECT slots FROM layouts WHERE layout_id=?", (lid,)).fetchone()
            hit = {s[0]: f"{s[1]} {s[2]}" for s in json.loads(row[0])} if row else {}
            layouts[lid] = hit
        return hit

    verdicts = {}
    for module, call, slot, placement, reduction in con.execute(
            f"SELECT module, call, slot, placement, reduction FROM points WHERE {OUTPUTS_SQL} ORDER BY sort_key"):
        verdicts.setdefault((module, call), (placement, reduction))
    for proc, step, idx, mid, call, t0, dur, lid, flags in con.execute(
            "SELECT proc, step, idx, module_id, call, t0, dur, layout_id, flags FROM spans "
            f"WHERE (flags & {schema.FLAG_REPLAYED}) = 0 ORDER BY rowid"):
        # A CUDA-graph replay's module spans have no measured times: its step event stands for them.
        start = step_start.get((proc, step))
        if start is None:
            continue
        path = modules.get(mid, "?")
        args = dict(tensors=layout_args(lid), call=call)
        v = verdicts.get((path, call))
        if v is not None:
            args["placement"], args["reduction"] = v
        if flags & 1:
            args["captured"] = True
        yield dict(ph="X", pid=procs[proc]["pid"], tid=TID_MODULES, name=path or "<root>",
                   ts=_us(start + t0 - origin), dur=_us(dur), args=args)
    groups = {gid: (name, json.loads(ranks)) for gid, name, ranks in con.execute(
        "SELECT group_id, name, ranks FROM groups")}
    for proc, step, op, redop, gid, seq, t0, dur, lid, nbytes, mid, dev in con.execute(
            "SELECT proc, step, op, reduce_op, group_id, seq, t0, dur, layout_id, bytes, module_id, "
            f"device_ns FROM collectives WHERE (flags & {schema.FLAG_REPLAYED}) = 0 ORDER BY proc, step, idx"):
        start = step_start.get((proc, step))
        if start is None:
            continue
        gname, granks = groups.get(gid, ("?", []))
        ts = _us(start + t0 - origin)
        pid = procs[proc]["pid"]
        args = dict(group=gname, group_ranks=granks, seq=seq, bytes=nbytes,
                    module=modules.get(mid), tensors=layout_args(lid))
        if dev is not None:
            args["device_us"] = _us(dev)
        yield dict(ph="X", pid=pid, tid=TID_COLLECTIVES, name=op + (f"({redop})" if redop else ""), ts=ts,
                   dur=_us(dur), args=args)
        rank = procs[proc]["rank"]
        if len(granks) > 1 and rank in granks:
            pos = sorted(granks).index(rank)
            ph = "s" if pos == 0 else ("f" if pos == len(granks) - 1 else "t")
            flow = dict(ph=ph, pid=pid, tid=TID_COLLECTIVES, name=op, cat="collective",
                        id=(gid << 32) | (seq & 0xFFFFFFFF), ts=ts)
            if ph == "f":
                flow["bp"] = "e"
            yield flow


def export_perfetto(trace_dir: str, out: str | None = None, batch: int = 4096) -> dict:
    """Write ``trace_dir``'s timeline to ``out`` (default ``DIR/trace.perfetto.json.gz``)."""
    con = open_store(trace_dir)
    out = out or os.path.join(trace_dir, "trace.perfetto.json.gz")
    exporter = PerfettoExporter(out)
    pending = []
    bar = progress.Task.open("export perfetto: events")
    try:
        for event in timeline_events(con):
            pending.append(event)
            if len(pending) >= batch:
                exporter.export(pending)
                bar.advance(len(pending))
                pending = []
        if pending:
            exporter.export(pending)
    finally:
        bar.close()
        exporter.shutdown()
        con.close()
    return dict(path=out, events=exporter.events, bytes=os.path.getsize(out))
