"""Query benchmark: every question of the contract asked of one merged trace, through the CLI.

Each command runs in-process through click's ``CliRunner`` on ``tensor_trace.cli.main`` (the
code path of ``tensor-trace``, without an interpreter start per call), ``--reps`` times; the
median is reported against the target (< 2 s). The commands: ``query placement`` (all, a
layer's, one step's), ``reduction``, ``collectives``, ``shapes``, ``lineage``, ``diff`` (the
trace with itself), ``sql``, and ``compare`` (the trace with itself), ``check``, ``report``.
``merge_bench.py`` runs it in a child process against the store it merged; on its own it takes
a trace folder (merged first, untimed, when its store is missing or stale):

    OMP_NUM_THREADS=1 .venv/bin/python bench/query_bench.py /tmp/tt-synth --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_QUERY_S = 2.0
# Exit codes a command may end with and still have answered: 1 is an answer for check (findings)
# and compare (a divergence); lineage answers 1 for a point without recorded lineage.
ANSWERED = {"check": (0, 1), "compare": (0, 1), "lineage": (0, 1)}


def query_commands(d: str, out_dir: str) -> list:
    """(name, argv) of every timed command against the trace folder ``d``."""
    t = ["--trace", d, "--json"]
    return [
        ("placement", ["query", "placement", *t]),
        ("placement 'model.layers.30.*'", ["query", "placement", "model.layers.30.*", *t]),
        ("placement --step 5 'model.layers.0.*'", ["query", "placement", "--step", "5", "model.layers.0.*", *t]),
        ("reduction model.embed_tokens", ["query", "reduction", "model.embed_tokens", *t]),
        ("collectives", ["query", "collectives", *t]),
        ("shapes 'model.layers.*.self_attn.qkv_proj'", ["query", "shapes", "model.layers.*.self_attn.qkv_proj", *t]),
        ("lineage model.layers.0.mlp.down_proj", ["query", "lineage", "model.layers.0.mlp.down_proj", *t]),
        ('sql "SELECT COUNT(*) FROM spans"', ["query", "sql", "SELECT COUNT(*) FROM spans", *t]),
        ("diff DIR DIR", ["query", "diff", d, d, "--json"]),
        ("compare DIR DIR", ["compare", d, d, "--json", "-q"]),
        ("check", ["check", *t]),
        ("report", ["report", "--trace", d, "-o", os.path.join(out_dir, "report.html")]),
    ]


def _summary(data) -> str:
    if isinstance(data, list):
        return f"{len(data)} rows"
    if isinstance(data, dict):
        if "verdict" in data:
            return f"{data['verdict']} ({data['placement']})"
        return ", ".join(f"{k}: {len(v)}" for k, v in data.items() if isinstance(v, list))
    return str(data)[:60]


def run_queries(d: str, reps: int, log) -> list:
    """Time every command ``reps`` times in this process; a dict per command."""
    from click.testing import CliRunner

    from tensor_trace.cli import main as cli
    from tensor_trace.exporters.pipeline import open_store

    open_store(d).close()  # a stale store is merged here, not inside the first timed command
    runner = CliRunner()
    out = []
    with tempfile.TemporaryDirectory(prefix="tt-query-bench-") as tmp:
        for name, args in query_commands(d, tmp):
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                r = runner.invoke(cli, args, catch_exceptions=False)
                times.append(time.perf_counter() - t)
                if r.exit_code not in ANSWERED.get(args[0] if args[0] != "query" else args[1], (0,)):
                    raise SystemExit(f"{name} exited {r.exit_code}: {r.output[-2000:]}")
            try:
                summary = _summary(json.loads(r.output))
            except ValueError:
                summary = f"exit {r.exit_code}, {len(r.output)} bytes of output"
            out.append(dict(query=name, argv=args, times_s=times, median_s=statistics.median(times),
                            output_bytes=len(r.output), exit_code=r.exit_code, summary=summary))
            log(f"  {name}: median {statistics.median(times):.3f} s ({', '.join(f'{x:.3f}' for x in times)}), "
                f"exit {r.exit_code}: {summary}")
    return out


def queries_in_child(d: str, reps: int) -> list:
    """The queries run in a child process, so that the caller stays small (merge_bench's peak
    RSS figures start from its size at each fork)."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), d, "--reps", str(reps), "--json", out],
                       check=True)
        with open(out) as f:
            return json.load(f)["queries"]
    finally:
        os.remove(out)


def targets(queries: list, label: str = "") -> list:
    return [dict(name=f"query {label}{q['query']} (median)", value=f"{q['median_s']:.3f} s",
                 target=f"< {TARGET_QUERY_S} s", result="PASS" if q["median_s"] < TARGET_QUERY_S else "FAIL")
            for q in queries]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="trace folder (merged first when needed)")
    p.add_argument("--reps", type=int, default=3, help="runs of each command (the median is reported)")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    a = p.parse_args(argv)
    queries = run_queries(a.trace, a.reps, lambda m: print(m, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(queries=queries), f)
    failed = [t["name"] for t in targets(queries) if t["result"] == "FAIL"]
    print(f"queries: {len(queries) - len(failed)} under {TARGET_QUERY_S} s, {len(failed)} over"
          + (": " + "; ".join(failed) if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
