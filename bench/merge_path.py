"""The merge's critical path from CPU times, for ``merge_bench.py`` (its merge child process).

On a shared host a merge's wall time says more about the other load than about the merge. With
one process a core, the merge would take: the merging process's own rank files and its copies
of the workers' parts, in turn, each copy starting no earlier than the worker's CPU time when it
completed that part, then what follows the loading (indexes, clocks, verdicts). ``record_events``
times those pieces (CPU time of each process); ``critical_path`` adds them up.
"""
from __future__ import annotations

import time


def record_events(mg) -> list:
    """Record, in CPU time of the merging process, each rank file it loads and each worker part
    it copies (with the worker's CPU time when it completed that part)."""
    from tensor_trace.exporters.store import merge_workers

    events = []  # ("load" | "copy", cpu before, cpu after, the worker's cpu at the part or None)
    seen = {}
    read, copy, load = merge_workers.read_part, merge_workers.copy_part, getattr(mg, "load_file", None)

    def read_part(part):
        data = read(part)
        seen["worker_cpu"] = data.get("stats", {}).get("cpu_s")
        return data

    def copy_part(*a, **k):
        t = time.process_time()
        try:
            return copy(*a, **k)
        finally:
            events.append(("copy", t, time.process_time(), seen.get("worker_cpu")))

    def load_file(*a, **k):
        t = time.process_time()
        try:
            return load(*a, **k)
        finally:
            events.append(("load", t, time.process_time(), None))

    merge_workers.read_part, merge_workers.copy_part = read_part, copy_part
    if load is not None:
        mg.load_file = load_file
    return events


def critical_path(events: list, cpu: float, c0: float, beside: dict | None = None) -> dict | None:
    """The merge's wall time on dedicated cores (one a process), from CPU times: the merging
    process's own loading and copying in turn, each copy starting no earlier than the worker's
    CPU time when it completed that part, then what follows the loading. On a shared host this
    is what the wall time would be without the other load; ``None`` without timed events.
    ``beside``: the merge report's ``index_beside`` (CPU of the index built in a thread and of
    the verdicts beside it, both in the process's CPU time): they take the longer of the two."""
    if not events:
        return None
    t = 0.0
    for kind, a, b, worker_cpu in events:
        t = (t if kind == "load" or worker_cpu is None else max(t, worker_cpu)) + (b - a)
    tail = cpu - (events[-1][2] - c0)
    if beside and "index_cpu_s" in beside and "beside_cpu_s" in beside:
        tail -= min(beside["index_cpu_s"], beside["beside_cpu_s"])
    return dict(wall_s=t + tail, own_loads_s=sum(b - a for k, a, b, _ in events if k == "load"),
                copies_s=sum(b - a for k, a, b, _ in events if k == "copy"), after_loading_s=tail)
