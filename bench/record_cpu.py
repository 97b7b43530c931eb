"""`tensor-trace record` on a CPU as a user runs it: whole processes, side by side.

Variants, one process tree each, alternated within every round (a shuffled order per round):

- ``untraced``   ``torchrun --nproc-per-node 2 examples/tp_llama.py ARGS``;
- ``record``     ``tensor-trace record -o TMP --replace -- torchrun ... ARGS`` with default options;
- ``profiler``   the same example under ``torch.profiler.profile(record_shapes=True)`` in each rank
                 (CPU activity; bench/profiled_example.py);
- ``record-0:1`` ``record --steps 0:1``: only step 0 traced; its later steps run outside the window;
- ``record-nofp`` ``record --no-fingerprint`` (only with ``--variants``).

Per variant: the whole process tree's wall time (launch to exit, ``record``'s summary included),
and the steady-state step time: the example's per-step wall time on rank 0 (``step_wall_s`` in
its ``--out`` JSON; rank 0 waits for rank 1 at every collective, so it is the pair's step),
steps from ``--warmup`` on. The headline is the ratio of the median steady-state step to the
untraced one, with the median of the per-round ratios beside it (``paired``: a round's variants
run back to back, so its ratio cancels what moved the host between rounds; on 2 shared cores
rank 0's wall step spreads by +-30 % between rounds, and one slow untraced round moves the ratio
of medians where the paired median moves by one place); the mean steady-state step (which includes the periodic lineage steps of the
default schedule) and the whole-process ratio are printed beside it. For ``record-0:1`` every
steady-state step is outside the window: its ratio is what an untraced step costs with the
tracer installed (x1.00 is the target).

Workloads (``--workload``):

- ``example``: the example's default model (6 layers, hidden 96, 74 module calls a step);
- ``llama``: six Llama-shaped layers (hidden 1024, ffn 2816, 16 heads, 8 KV heads, vocab 32000,
  batch 2, seq 16), where a step does far more arithmetic per module call (the issue's "held-out
  2-rank model": profiler about x1.08 there).

    OMP_NUM_THREADS=1 .venv/bin/python bench/record_cpu.py --workload llama
    OMP_NUM_THREADS=1 .venv/bin/python bench/record_cpu.py --workload example --rounds 5

Every rank runs with ``OMP_NUM_THREADS=1`` (torchrun would otherwise set it to 1 itself and warn).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from common import ROOT, header, header_line, median, shuffled_rounds  # bench/ is first on sys.path

# the variants under record, and record's options in each (record-nofp: on request, not by default)
RECORD_OPTIONS = {"record": [], "record-0:1": ["--steps", "0:1"], "record-nofp": ["--no-fingerprint"]}
VARIANTS = ("untraced", "record", "profiler", "record-0:1", "record-nofp")
DEFAULT_VARIANTS = VARIANTS[:4]
WORKLOADS = {
    "example": [],
    "llama": ["--hidden", "1024", "--ffn", "2816", "--heads", "16", "--kv-heads", "8",
              "--head-dim", "64", "--vocab", "32000", "--seq", "16", "--batch", "2"],
}
BIN = os.path.dirname(os.path.abspath(sys.executable))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(variant: str, example_args: list, out_json: str, trace_dir: str, nproc: int) -> list:
    """The argv of one variant's process tree."""
    script = "bench/profiled_example.py" if variant == "profiler" else "examples/tp_llama.py"
    run = [os.path.join(BIN, "torchrun"), "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), script, *example_args, "--out", out_json]
    if variant not in RECORD_OPTIONS:
        return run
    return [os.path.join(BIN, "tensor-trace"), "record", "-o", trace_dir, "--replace", *RECORD_OPTIONS[variant],
            "--", *run]


def run_once(variant: str, args, work: str) -> dict:
    """Run one variant's process tree; its wall time, per-step times and trace size."""
    out_json = os.path.join(work, f"{variant}.json")
    trace_dir = os.path.join(work, f"trace-{variant}")
    if os.path.exists(out_json):
        os.remove(out_json)
    argv = command(variant, args.example_args, out_json, trace_dir, args.nproc)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.path.join(ROOT, "bench"), os.environ.get("PYTHONPATH")) if p))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the tree: each parent waited for its children)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        sys.exit(f"{variant} failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
    with open(out_json) as f:
        out = json.load(f)
    steps, steps_cpu = out["step_wall_s"], out["step_cpu_s"]
    trace_bytes = 0
    if os.path.isdir(trace_dir):
        for dirpath, _, files in os.walk(trace_dir):
            trace_bytes += sum(os.path.getsize(os.path.join(dirpath, name)) for name in files)
    steady = steps[args.warmup:]
    print(f"  {variant:<11} step median {median(steady) * 1e3:8.2f} ms, CPU {median(steps_cpu[args.warmup:]) * 1e3:8.2f} "
          f"ms; process {wall:7.2f} s, CPU {cpu:7.2f} s", flush=True)
    return dict(wall_s=wall, cpu_s=cpu, steps_s=steps, steps_cpu_s=steps_cpu, step_median_s=median(steady),
                step_mean_s=sum(steady) / len(steady), step_cpu_s=median(steps_cpu[args.warmup:]),
                trace_bytes=trace_bytes)


# (key, column title, unit): the figures of a run, in the table's order
FIGURES = (("step_median_s", "step median", "ms"), ("step_mean_s", "step mean", "ms"),
           ("step_cpu_s", "step CPU", "ms"), ("wall_s", "process wall", "s"), ("cpu_s", "process CPU", "s"))


def summarize(times: dict) -> dict:
    """Per variant: medians over rounds, and each figure's ratio to untraced: the ratio of the
    medians, the median of the per-round ratios (``_paired``: the variants of one round ran back
    to back, so a round's ratio cancels what moved the host between rounds, where the ratio of
    medians pairs the median untraced run with a record run of another round), and their
    min..max."""
    out = {}
    base = times["untraced"]
    for variant, runs in times.items():
        row = {}
        for key, _, _ in FIGURES:
            vals = [r[key] for r in runs]
            row[key] = median(vals)
            per_round = [r[key] / b[key] for r, b in zip(runs, base)]
            row[key + "_ratio"] = row[key] / median([b[key] for b in base])
            row[key + "_paired"] = median(per_round)
            row[key + "_ratio_range"] = (min(per_round), max(per_round))
        row["trace_bytes"] = median([r["trace_bytes"] for r in runs])
        out[variant] = row
    return out


def print_table(summary: dict, args) -> None:
    print(f"\n== {args.workload}: {args.nproc} ranks, {args.steps} steps, steady state = steps "
          f"{args.warmup}..{args.steps - 1}, {args.rounds} rounds. Medians over rounds, their ratio to "
          f"untraced [the median of the per-round ratios], and per-round ratios min-max. Step: rank 0's "
          f"forward call (mean: with the periodic lineage steps; CPU: rank 0's process CPU time); "
          f"process: the whole tree ==")
    print(f"{'variant':<11}" + "".join(f" {title:>38}" for _, title, _ in FIGURES) + f" {'trace':>9}")
    for variant, row in summary.items():
        cells = []
        for key, _, unit in FIGURES:
            lo, hi = row[key + "_ratio_range"]
            value = row[key] * (1e3 if unit == "ms" else 1)
            cells.append(f"{value:>7.2f} {unit:<2} x{row[key + '_ratio']:.3f} [x{row[key + '_paired']:.3f}] "
                         f"({lo:.2f}-{hi:.2f})")
        print(f"{variant:<11} " + " ".join(cells) + f" {row['trace_bytes'] / 1e6:>6.2f} MB")
    base = summary["untraced"]["step_median_s"]

    def step(variant):
        row = summary[variant]
        return f"x{row['step_median_s'] / base:.3f} [paired x{row['step_median_s_paired']:.3f}]"

    lines = [f"headline: record step {step('record')} of untraced" if "record" in summary else None,
             f"profiler step {step('profiler')}" if "profiler" in summary else None,
             f"record --steps 0:1, steps outside the window {step('record-0:1')}"
             if "record-0:1" in summary else None]
    print("; ".join(x for x in lines if x))


def native_ready() -> str:
    """tracer/native.py built now where the traced ranks will use it (the default where it can be
    built), not by the first rounds' ranks: each loads the finished build at its first step."""
    from tensor_trace.tracer import native

    if not native.enabled():
        return "off (the Python path)"
    t0 = time.perf_counter()
    native.ensure(block=True)
    if native.pair_key() is None:
        return f"UNAVAILABLE ({native.error()}): the Python path"
    return f"ready in {time.perf_counter() - t0:.1f} s (the C call wrapper from each rank's second step)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="llama")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=4,
                   help="first steps left out of the steady state (default 4: the lineage steps and the first fingerprinted ones)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                   help="untraced always runs (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round order")
    p.add_argument("--keep", metavar="DIR", help="work folder kept afterwards (default: a temporary one, removed)")
    p.add_argument("--json", metavar="PATH", help="write the figures and every run's step times here")
    p.add_argument("extra", nargs="*", help="more example arguments, after --")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    variants = ["untraced", *[v for v in args.variants if v != "untraced"]]
    args.example_args = [*WORKLOADS[args.workload], "--steps", str(args.steps), *args.extra]
    info = header(sys.argv)
    print(header_line("record_cpu", info))
    print(f"# example arguments: {' '.join(args.example_args)}")
    # Bytecode for the tree's modules, as an installed package has (pip compiles at install): with
    # PYTHONDONTWRITEBYTECODE set, as on this workplace's VM, every traced process would compile
    # tensor_trace's modules again (about 0.15 s of CPU each), which no user pays.
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(os.path.join(ROOT, d) for d in
                    ("tensor_trace", "tracer", "exporters", "examples", "bench"))], check=True)
    print(f"# tracer/native.py (TENSOR_TRACE_NATIVE={os.environ.get('TENSOR_TRACE_NATIVE', 'auto')}): "
          f"{native_ready()}", flush=True)
    work = args.keep or tempfile.mkdtemp(prefix="tt-record-cpu-")
    os.makedirs(work, exist_ok=True)
    try:
        times = shuffled_rounds(lambda v: run_once(v, args, work), variants, args.rounds, args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(times)
    print_table(summary, args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(header=info, workload=args.workload, example_args=args.example_args,
                           warmup=args.warmup, summary=summary, runs=times), f, indent=1)


if __name__ == "__main__":
    main()
