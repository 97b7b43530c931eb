"""`tensor-trace report` on the 2-million-span synthetic trace (issue #23: < 20 s, < 5 MB).

1. ``bench/synth.py`` writes the TP=8, 61-layer trace of the merge benchmark (about 2 million
   span records: module spans + collectives, ~312 steps); it is merged once (``tensor-trace
   merge``, timed apart: a store is merged once, then reported on any number of times).
2. ``tensor-trace report --trace DIR -o FILE.html`` runs as a user runs it, in a child process,
   ``--reps`` times: the median wall time, CPU time and peak RSS of the child, and the page's
   size are the figures, with what the page holds (layers, points, findings).
3. ``--with-compare``: once more with ``--compare`` against a copy of the trace (the comparison
   of two 2M-span traces is the compare benchmark's figure; here only what it adds to a report).

    python bench/report_bench.py                   # ~2M span records, TP=8
    python bench/report_bench.py --steps 20        # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare_bench import timed_child  # noqa: E402  (wall, CPU, peak RSS of a child)
from common import synthetic_trace_options, synthetic_trace_work  # noqa: E402

TARGET_S = 20.0
TARGET_BYTES = 5 * 1024 * 1024
BIN = os.path.dirname(sys.executable)
TT = os.path.join(BIN, "tensor-trace")


def _generate(trace: str, args, env, info) -> None:
    store = os.path.join(trace, "merged.sqlite")
    if args.reuse and os.path.exists(store):
        info["reused"] = trace
        return
    t = time.perf_counter()
    gen = [sys.executable, os.path.join(HERE, "synth.py"), "--out", trace, "--ranks", str(args.ranks)]
    if args.steps:
        gen += ["--steps", str(args.steps)]
    subprocess.run(gen, check=True, env=env, stdout=subprocess.DEVNULL)
    info["generate_s"] = round(time.perf_counter() - t, 1)
    wall, _, _, _, _ = timed_child([TT, "merge", trace], env)
    info["merge_s"] = round(wall, 1)


def _page_counts(page: str) -> dict:
    with open(page, encoding="utf-8") as f:
        text = f.read()
    literal = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', text, re.S).group(1)
    data = json.loads(literal)
    return dict(layers=sum(len(s["layers"]) for s in data["stacks"]), columns=[len(s["columns"]) for s in data["stacks"]],
                points=len(data["points"]), findings=len(data["findings"]), collective_rows=len(data["collectives"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    synthetic_trace_options(p)
    p.add_argument("--reuse", action="store_true", help="with --dir: keep DIR/a if an earlier run merged it")
    p.add_argument("--with-compare", action="store_true", help="also time report --compare against a copy")
    args = p.parse_args(argv)
    info, work, env = synthetic_trace_work(args, "report")
    trace = os.path.join(work, "a")
    page = os.path.join(work, "report.html")
    try:
        _generate(trace, args, env, info)
        con = sqlite3.connect(f"file:{os.path.join(trace, 'merged.sqlite')}?mode=ro", uri=True)
        info["span_records"] = (con.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
                                + con.execute("SELECT COUNT(*) FROM collectives").fetchone()[0])
        info["steps"] = con.execute("SELECT COUNT(DISTINCT step) FROM steps").fetchone()[0]
        con.close()
        walls, cpus, rsss = [], [], []
        for _ in range(args.reps):
            wall, cpu, rss, _, _ = timed_child([TT, "report", "--trace", trace, "-o", page], env)
            walls.append(wall)
            cpus.append(cpu)
            rsss.append(rss)
        size = os.path.getsize(page)
        info.update(report_s=[round(w, 2) for w in walls], report_median_s=round(statistics.median(walls), 2),
                    report_cpu_s=[round(c, 2) for c in cpus], report_rss_peak_mb=round(max(rsss) / 1024),
                    html_bytes=size, page=_page_counts(page), target_s=TARGET_S, target_bytes=TARGET_BYTES,
                    met=statistics.median(walls) < TARGET_S and size < TARGET_BYTES)
        if args.with_compare:
            b = os.path.join(work, "b")
            if not os.path.exists(b):
                shutil.copytree(trace, b)
            wall, cpu, rss, _, _ = timed_child([TT, "report", "--trace", trace, "--compare", b, "-o", page], env)
            info.update(report_compare_s=round(wall, 2), report_compare_cpu_s=round(cpu, 2),
                        report_compare_bytes=os.path.getsize(page))
        info["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(info, f, indent=1)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{info['date']} {info['cpu']} ({info['cpus']} cpus), commit {info['git']}")
    print(f"uptime before: {info['uptime_before']}")
    made = (f"reused {info['reused']}" if info.get("reused")
            else f"generated in {info['generate_s']} s, merged in {info['merge_s']} s")
    print(f"trace: {info['span_records']:,} span records, {info['steps']} steps x {args.ranks} ranks; {made}")
    print(f"report: wall median {info['report_median_s']} s over {args.reps} runs {info['report_s']}; "
          f"CPU {info['report_cpu_s']} s; peak RSS {info['report_rss_peak_mb']} MB; "
          f"HTML {info['html_bytes']:,} bytes; page {info['page']}")
    if args.with_compare:
        print(f"report --compare (a copy): wall {info['report_compare_s']} s, CPU {info['report_compare_cpu_s']} s, "
              f"HTML {info['report_compare_bytes']:,} bytes")
    print(f"uptime after: {info['uptime_after']}")
    print(f"target < {TARGET_S:g} s and < {TARGET_BYTES / 2**20:g} MB: {'met' if info['met'] else 'NOT met'}")
    return 0 if info["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
