"""`tensor-trace compare` of two 2-million-span synthetic traces (issue #21: under 30 s).

1. ``bench/synth.py`` writes a TP=8 trace of about 2 million span records (module spans +
   collectives, 61 decoder layers, ~312 steps); the second trace is a copy of its rank files
   under another folder (the same run twice: every point must compare ``same``, and compare
   reads every point of every step, its worst case).
2. Each trace is merged (``tensor-trace merge``, timed apart: a store is merged once and then
   compared any number of times).
3. ``tensor-trace compare A B --json`` runs as a user runs it, in a child process, ``--reps``
   times; the median wall time is the figure, with the child's peak RSS and the status counts.

    python bench/compare_bench.py                 # ~2M span records per trace, TP=8
    python bench/compare_bench.py --steps 20      # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from merge_bench import header  # noqa: E402  (date, host, cpu, git commit, command)

TARGET_S = 30.0
BIN = os.path.dirname(sys.executable)
TT = os.path.join(BIN, "tensor-trace")


def timed_child(cmd: list, env=None) -> tuple:
    """(wall seconds, peak RSS in KiB, stdout) of one child process."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = p.communicate()
    wall = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {err.decode()[-2000:]}")
    return wall, ru, out, p.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="default: ~2 million span records per trace")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    info = header(sys.argv)
    work = args.dir or tempfile.mkdtemp(prefix="tt-compare-bench-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    a, b = os.path.join(work, "a"), os.path.join(work, "b")
    try:
        t = time.perf_counter()
        gen = [sys.executable, os.path.join(HERE, "synth.py"), "--out", a, "--ranks", str(args.ranks)]
        if args.steps:
            gen += ["--steps", str(args.steps)]
        subprocess.run(gen, check=True, env=env, stdout=subprocess.DEVNULL)
        if os.path.exists(b):
            shutil.rmtree(b)
        shutil.copytree(a, b)
        info["generate_s"] = round(time.perf_counter() - t, 1)
        for d in (a, b):
            wall, _, _, _ = timed_child([TT, "merge", d], env)
            info.setdefault("merge_s", []).append(round(wall, 1))
        import sqlite3

        con = sqlite3.connect(os.path.join(a, "merged.sqlite"))
        info["span_records"] = (con.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
                                + con.execute("SELECT COUNT(*) FROM collectives").fetchone()[0])
        info["steps"] = con.execute("SELECT COUNT(DISTINCT step) FROM steps").fetchone()[0]
        info["points"] = con.execute("SELECT COUNT(*) FROM points").fetchone()[0]
        con.close()
        walls = []
        for _ in range(args.reps):
            wall, rss, out, rc = timed_child([TT, "compare", a, b, "--json"], env)
            walls.append(wall)
        res = json.loads(out)
        counts: dict = {}
        for pt in res["points"]:
            counts[pt["status"]] = counts.get(pt["status"], 0) + 1
        info.update(compare_s=[round(w, 2) for w in walls], compare_median_s=round(statistics.median(walls), 2),
                    compare_rss_peak_mb=round(rss / 1024), statuses=counts, exit_code=rc,
                    step_pairs=len(res["steps"]), first_divergence=res["first_divergence"],
                    target_s=TARGET_S, met=statistics.median(walls) < TARGET_S)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{info['date']} {info['cpu']} ({info['cpus']} cpus), commit {info['git']}")
    print(f"uptime before: {info['uptime_before']}")
    print(f"traces: {info['span_records']:,} span records each, {info['steps']} steps x {args.ranks} ranks, "
          f"{info['points']} points; generated in {info['generate_s']} s, merged in {info['merge_s']} s")
    print(f"compare A B --json: median {info['compare_median_s']} s over {args.reps} runs {info['compare_s']}, "
          f"peak RSS {info['compare_rss_peak_mb']} MB, {info['step_pairs']} step pairs, statuses {info['statuses']}, "
          f"exit {info['exit_code']}")
    print(f"target < {TARGET_S:g} s: {'met' if info['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0 if info["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
