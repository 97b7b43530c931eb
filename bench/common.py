"""Timing and reporting helpers the benchmarks share: the header of a run (date, host, commit,
command), percentiles, step-paired rounds.

No torch here: merge_bench.py and compare_bench.py keep their own process small, because a merge
child's peak-RSS figure starts from its parent's RSS at the fork (models.py holds the models)."""
from __future__ import annotations

import datetime
import math
import os
import platform
import random
import shlex
import socket
import sqlite3
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------------------- header


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def load_summary() -> str:
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git() -> str:
    """HEAD of the library's repository, and whether the library folders differ from it; where
    the tree is a copy (a lent GPU machine, whose copy may carry a stale ``.git``), the commit
    named in ``$BENCH_COMMIT`` (gpu_run.sh sets it) wins."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        return "?"
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "exporters", "tracer",
                                "tensor_trace"], capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}{' (library modified)' if dirty else ''}" if head else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def header(argv) -> dict:
    """What a figure needs beside it: date, host, CPU, versions, commit and the command. Versions
    come from package metadata, so this imports no torch."""
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                hostname=socket.gethostname(), cpu=_cpu_model(), cpus=os.cpu_count(),
                python=platform.python_version(), torch=_version("torch"),
                sqlite=sqlite3.sqlite_version, msgpack=_version("msgpack"),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                command=" ".join(shlex.quote(a) for a in [sys.executable, *argv]), git=_git(),
                uptime_before=load_summary())


def header_line(name: str, h: dict, device: str | None = None) -> str:
    """The first line a benchmark prints: ``# NAME | date | host | commit | device | command``."""
    return (f"# {name} | {h['date']} | host {h['hostname']} ({h['cpus']} cpus) | commit {h['git']} | "
            f"{device or h['cpu']} | torch {h['torch']} | python {h['python']} | "
            f"OMP_NUM_THREADS={h['omp_num_threads']} | {h['uptime_before'].split('load average:')[-1].strip()} load"
            f"\n# command: {h['command']}")


# ---------------------------------------------------------------------------- statistics


def percentile(vals, q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of ``vals`` (any order)."""
    vals = sorted(vals)
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def median(vals) -> float:
    return percentile(vals, 50)


# ---------------------------------------------------------------------------- step-paired rounds
# The method of record on the lent GPU hosts, whose speed drifts within a minute: every round runs
# one step of each variant, in shuffled order, so that consecutive steps differ only in the
# variant and a drifting host moves all variants alike.


def shuffled_rounds(run, variants, rounds: int, seed: int = 0) -> dict:
    """``run(variant)`` -> ns, once per variant per round in a shuffled order; the times by
    variant, in round order (so ``times[a][i]`` and ``times[b][i]`` are one round's pair)."""
    rng = random.Random(seed)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            times[v].append(run(v))
    return times


def paired_median(times: dict, a: str, b: str) -> float:
    """The median over rounds of ``a``'s time minus ``b``'s, in the unit of ``times``."""
    return statistics.median(x - y for x, y in zip(times[a], times[b]))


def paired_ratio(times: dict, a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def synthetic_trace_options(parser, per_trace: str = "") -> None:
    """The options of a benchmark over bench/synth.py's synthetic TP=8 trace (compare, report):
    its size, the repetitions, the work folder and where the figures go."""
    parser.add_argument("--steps", type=int, default=None, help=f"default: ~2 million span records{per_trace}")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")


def synthetic_trace_work(args, name: str) -> tuple:
    """(header, work folder, environment of the timed children) of such a benchmark: the folder
    ``--dir`` names or a new temporary one; children run on one thread unless told otherwise."""
    import tempfile

    info = header(sys.argv)
    work = args.dir or tempfile.mkdtemp(prefix=f"tt-{name}-bench-")
    os.makedirs(work, exist_ok=True)
    return info, work, dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
