"""Merge benchmark: a synthetic TP=8 trace (2 million span records by default), merged and queried.

1. ``bench/synth.py`` writes a trace of realistic shape with the real ``RankWriter``: 8 ranks
   (``--ranks``), a 61-layer DeepSeek/Llama-sized decoder with the module tree of
   ``examples/tp_llama.py``, 676 module spans + 124 collectives = 800 span records per step and
   rank, ``--records`` span records in all (default 2,000,000); a smaller trace
   (``--small-records``, default a quarter) is written too. Steps are simulated record for
   record; ``--repeat-after K`` simulates only the first K steps and repeats steps 1..K-1 after
   them (new step numbers, clock readings and sequence numbers): how a 20M-record trace is made
   in minutes (the default from 4M records on).
2. ``merge_ranks(DIR)`` runs in a fresh child process per trace (``--merge-child DIR OUT``): wall
   and CPU time (``time.process_time``; the merge's worker processes report their own, shown
   besides and summed) of the call, span records merged per second (module spans + collectives
   of all ranks / wall time), time per phase (loading the rank files (with the workers: until
   their parts are copied in), collective alignment, clock offsets, verdicts, the rest =
   indexes, commit), rows in the store against what was generated, and the merge's memory for
   both sizes: its peak RSS increment (``VmHWM`` - ``VmRSS`` after imports, of the merging
   process and of each worker, summed), which a streaming merge keeps the same for both. The
   child's ``ru_maxrss`` is shown too (Linux carries a parent's RSS at the fork into it, so this
   process stays small: generation and queries run in child processes).
   ``--workers N`` sets ``TENSOR_TRACE_MERGE_WORKERS`` (default: the library's choice).
   ``--compare-with FILE`` (a ``merge.py`` of another commit, e.g. ``git show
   REV:exporters/store/merge.py > /tmp/merge_before.py``) adds the variant ``before``: that
   module in place of the library's, merging the same rank files; ``--merge-rounds R`` merges
   each trace R times per variant, variants interleaved, and reports the run of median wall time.
3. ``bench/query_bench.py`` in a child process: every question of the contract asked of the
   large trace's store through the CLI code path (``--reps`` runs each, the median).
4. A table with PASS/FAIL against the targets (store complete; merge >= 1,000,000 span records/s;
   the merge's memory flat in trace size; each query < 2 s); ``--json PATH`` writes every
   figure. When the merge misses its rate, ``cProfile`` of ``merge_ranks`` on the small trace
   (or ``--profile-steps``) prints the top functions by cumulative and by own time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/merge_bench.py --profile never
    OMP_NUM_THREADS=1 .venv/bin/python bench/merge_bench.py --records 20000000 --small-records 2000000 --reps 1 --profile never --dir /tmp/mb20
    OMP_NUM_THREADS=1 .venv/bin/python bench/merge_bench.py --records 200000 --reps 1   # a quick look
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TARGET_RATE = 1_000_000  # span records merged per second (issue #22: on the 2-core VM)
TARGET_RSS_GROWTH = 1.5  # merge RSS increment, large / small trace (their size ratio = not streaming)
RECORDS_PER_STEP = 11 * 61 + 5 + 2 * 61 + 2  # synth.py's model: module spans + collectives, a step and rank
REPEAT_FROM_RECORDS = 4_000_000  # larger traces repeat simulated steps (--repeat-after) by default
REPEAT_AFTER = 8

import merge_floor  # noqa: E402
import merge_path  # noqa: E402
import merge_profile  # noqa: E402
import query_bench  # noqa: E402
from common import header, load_summary  # noqa: E402  (torch-free: this process stays small)


# ---------------------------------------------------------------------------- merge (child)


def store_counts(trace_dir: str) -> dict:
    con = sqlite3.connect(f"file:{os.path.join(trace_dir, 'merged.sqlite')}?mode=ro", uri=True)
    out = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
           for t in ("spans", "collectives", "fingerprints", "steps", "params", "points")}
    out["max_span_step"] = con.execute("SELECT MAX(step) FROM spans").fetchone()[0]
    con.close()
    return out


def _merge_module(module_file: str | None):
    """The library's merge module, or (``--compare-with``) another version of it from a file."""
    if not module_file:
        from tensor_trace.exporters.store import merge as mg

        return mg
    import importlib.util

    spec = importlib.util.spec_from_file_location("tensor_trace.exporters.merge_before", module_file)
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    return mg


def merge_child(trace_dir: str, out_path: str, module_file: str | None) -> None:
    """Run in a fresh process: merge once, with light timers around the phases."""
    from tensor_trace.exporters import analysis as pl

    mg = _merge_module(module_file)
    phases = collections.defaultdict(float)
    hwm = {}  # VmHWM when each phase last ended: the phase that raises it holds the memory

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - t
                hwm[name] = _vm("VmHWM")
        return wrapper

    def timed_gen(name, fn):
        # The loading generator: its time is the time spent inside it (the merging process's
        # own files, waiting for the workers, copying their parts).
        def wrapper(*a, **k):
            it = fn(*a, **k)
            while True:
                t = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    phases[name] += time.perf_counter() - t
                    hwm[name] = _vm("VmHWM")
                yield item
        return wrapper

    events = merge_path.record_events(mg)
    if hasattr(mg, "_load_rank_files"):
        mg._load_rank_files = timed_gen("load rank files", mg._load_rank_files)
    else:
        mg._FileLoader.load = timed("load rank files", mg._FileLoader.load)
    mg.align_collectives = timed("align collectives", mg.align_collectives)
    mg.estimate_clock_offsets = timed("clock offsets", mg.estimate_clock_offsets)
    pl.compute_verdicts = timed("verdicts", pl.compute_verdicts)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vm0 = _vm("VmRSS")
    warnings = []
    w0, c0 = time.perf_counter(), time.process_time()
    report = mg.merge_ranks(trace_dir, warn=warnings.append, analyse=lambda con: pl.compute_verdicts(con))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    phases["other (inserts of processes/globals, indexes, commit)"] = wall - sum(phases.values())
    critical = merge_path.critical_path(events, cpu, c0, report.get("index_beside"))
    res = dict(wall_s=wall, cpu_s=cpu, rss_after_import_kb=rss0, vmrss_after_import_kb=vm0,
               vmhwm_kb=_vm("VmHWM"), rss_peak_self_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               phases=dict(phases), vmhwm_after_phase_kb=hwm, points=report["points"], warnings=warnings,
               collective_issues=[list(i) for i in report["collective_issues"]],
               workers=report.get("workers", []), counts=store_counts(trace_dir), critical_path=critical)
    with open(out_path, "w") as f:
        json.dump(res, f)


def _vm(key: str) -> int | None:
    """A /proc/self/status figure in kB (VmHWM: this image's peak RSS, VmRSS: now)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def generate_in_child(d: str, steps: int, ranks: int, seed: int, spread: str, repeat_after: int | None) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    subprocess.run([sys.executable, os.path.join(HERE, "synth.py"), "--out", d, "--steps", str(steps),
                    "--ranks", str(ranks), "--seed", str(seed), "--fp-spread", spread, "--info-json", out]
                   + (["--repeat-after", str(repeat_after)] if repeat_after and steps > repeat_after else []),
                   check=True)
    with open(out) as f:
        info = json.load(f)
    os.remove(out)
    return info


def floor_in_child(rank_file: str) -> dict:
    r = subprocess.run([sys.executable, os.path.join(HERE, "merge_floor.py"), rank_file], check=True,
                       capture_output=True, text=True)
    return json.loads(r.stdout)


def merge_in_child(trace_dir: str, module_file: str | None = None, workers: int | None = None) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if workers is not None:
        env["TENSOR_TRACE_MERGE_WORKERS"] = str(workers)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--merge-child", trace_dir, out]
                         + (["--merge-module", module_file] if module_file else []), env=env)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"merge child failed with status {p.returncode}")
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    res["rss_peak_kb"] = ru.ru_maxrss
    res["rss_children_kb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res["rss_children_before_kb"] = children_before  # the generator children count in it too
    res["store_bytes"] = os.path.getsize(os.path.join(trace_dir, "merged.sqlite"))
    ws = res.get("workers") or []
    res["cpu_all_s"] = res["cpu_s"] + sum(w.get("cpu_s") or 0 for w in ws)
    # Memory the merge itself takes, all processes: the merging one's growth after its imports
    # plus each worker's growth after its start.
    res["merge_mem_kb"] = (res["vmhwm_kb"] - res["vmrss_after_import_kb"]
                           + sum((w.get("peak_rss_kb") or 0) - (w.get("rss_start_kb") or 0) for w in ws))
    res["peak_all_kb"] = res["vmhwm_kb"] + sum(w.get("peak_rss_kb") or 0 for w in ws)
    return res


# ---------------------------------------------------------------------------- report

VARIANT_NOTE = {"as-is": "the library as it is",
                "before": "merge.py from --compare-with in place of the library's (same rank files, reader, analysis)"}


def _mb(n):
    return f"{n / 2**20:.1f} MiB"


def expected_counts(g: dict) -> dict:
    return dict(spans=g["spans"], collectives=g["collectives"], steps=g["steps"] * g["ranks"],
                fingerprints=g["fingerprint_records"])


def _complete(m: dict, g: dict) -> tuple:
    exp = expected_counts(g)
    got = m["counts"]
    bad = [f"{k} {got[k]:,} of {v:,}" for k, v in exp.items() if got[k] != v]
    return (not bad), ("all rows" if not bad else "; ".join(bad))


def print_table(res: dict) -> None:
    h = res["header"]
    print()
    print(f"# tensor-trace merge/query benchmark | {h['date']} | host {h['hostname']} | cpu {h['cpu']} x{h['cpus']}"
          f" | python {h['python']} | torch {h['torch']} | sqlite {h['sqlite']} | msgpack {h['msgpack']}"
          f" | OMP_NUM_THREADS={h['omp_num_threads']} | git {h['git']}")
    print(f"# command: {h['command']}")
    print(f"# before: {h['uptime_before']}")
    print(f"# after:  {h.get('uptime_after', '?')}")
    for v in res["merge"]:
        print(f"# merge variant {v}: {VARIANT_NOTE.get(v, v)}"
              + (f" ({res['args'].get('compare_with')})" if v == "before" else ""))
    info = []
    for label, g in res["traces"].items():
        info.append((f"trace {label}: steps x ranks", f"{g['steps']} x {g['ranks']}"))
        info.append((f"trace {label}: span records (module spans + collectives)",
                     f"{g['span_records']:,} ({g['spans']:,} + {g['collectives']:,})"))
        info.append((f"trace {label}: rank files / generation", f"{_mb(g['bytes'])} / {g['seconds']:.1f} s"))
    for variant in res["merge"]:
        for label, g in res["traces"].items():
            m = res["merge"].get(variant, {}).get(label)
            if not m:
                continue
            pre = f"merge {variant} {label}:"
            ws = m.get("workers") or []
            info.append((f"{pre} wall / cpu", f"{m['wall_s']:.2f} s / {m['cpu_s']:.2f} s"
                         + (f" (+ {len(ws)} worker(s) {sum(w['cpu_s'] for w in ws):.2f} s = {m['cpu_all_s']:.2f} s)"
                            if ws else "")))
            if len(m.get("walls", [])) > 1:
                info.append((f"{pre} walls of the {len(m['walls'])} rounds", ", ".join(f"{w:.2f}" for w in m["walls"])))
            info.append((f"{pre} span records/s (module spans/s)", f"{m['rate']:,.0f} ({m['module_rate']:,.0f})"))
            for ph, sec in m["phases"].items():
                peak = m["vmhwm_after_phase_kb"].get(ph)
                info.append((f"{pre}   {ph}", f"{sec:.2f} s ({100 * sec / m['wall_s']:.0f}%)"
                             + (f", VmHWM after it {_mb(peak * 1024)}" if peak else "")))
            info.append((f"{pre} peak RSS: child ru_maxrss (wait4) / VmHWM",
                         f"{_mb(m['rss_peak_kb'] * 1024)} / {_mb(m['vmhwm_kb'] * 1024)}"))
            for k, w in enumerate(ws, 1):
                info.append((f"{pre} worker {k}: files / VmHWM / VmRSS at start / cpu",
                             f"{w['files']} / {_mb((w.get('peak_rss_kb') or 0) * 1024)} / "
                             f"{_mb((w.get('rss_start_kb') or 0) * 1024)} / {w['cpu_s']:.2f} s"))
            if ws:
                info.append((f"{pre} peak RSS, merging process + workers (sum of VmHWM)", _mb(m["peak_all_kb"] * 1024)))
            info.append((f"{pre} RSS after imports (VmRSS)", _mb(m["vmrss_after_import_kb"] * 1024)))
            info.append((f"{pre} RUSAGE_CHILDREN ru_maxrss before / after",
                         f"{_mb(m['rss_children_before_kb'] * 1024)} / {_mb(m['rss_children_kb'] * 1024)}"))
            info.append((f"{pre} store size", f"{_mb(m['store_bytes'])} ({m['store_bytes'] / g['bytes']:.2f}x the rank files)"))
            c = m["counts"]
            info.append((f"{pre} rows in store", f"spans {c['spans']:,}, collectives {c['collectives']:,}, "
                         f"fingerprints {c['fingerprints']:,}, steps {c['steps']:,}, last span step {c['max_span_step']}"))
    for variant, qs in res["queries"].items():
        for q in qs:
            info.append((f"query [{variant} store] {q['query']}", f"{q['median_s']:.3f} s (" + ", ".join(
                f"{x:.3f}" for x in q["times_s"]) + f"; {q['summary']})"))
    rows = [(n, v, "", "") for n, v in info] + [("", "", "", "")] + [
        (t["name"], t["value"], t["target"], t["result"]) for t in res["targets"]]
    allrows = [("figure", "value", "target", "result")] + rows
    w = [max(len(str(r[i])) for r in allrows) for i in range(4)]
    for n, r in enumerate(allrows):
        print("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip())
        if n == 0:
            print("  ".join("-" * x for x in w))


def targets(res: dict) -> list:
    out = []
    for variant in ("as-is",):  # the targets are the library's; "before" is shown for comparison
        ms = res["merge"].get(variant)
        if not ms:
            continue
        big, small = ms["large"], ms.get("small")
        g = res["traces"]["large"]
        ok, text = _complete(big, g)
        out.append(dict(name=f"[{variant}] store holds every record of the large trace", value=text,
                        target="all rows", result="PASS" if ok else "FAIL"))
        out.append(dict(name=f"[{variant}] merge rate, large trace (span records/s)", value=f"{big['rate']:,.0f}",
                        target=f">= {TARGET_RATE:,}", result="PASS" if big["rate"] >= TARGET_RATE else "FAIL"))
        fl = res.get("floor")
        if fl:
            cores = res["header"]["cpus"]
            out.append(dict(name=f"  floor: decode + insert alone ({fl['us_per_span_record']:.2f} µs a span record, "
                                 f"+ {fl.get('copy_us_per_span_record', 0):.2f} to copy a worker's, "
                                 f"merge_floor.py), over {cores} cores",
                            value=f"{fl['rate']:,.0f} (the merge {big['rate'] / fl['rate']:.2f} of it)",
                            target="", result=""))
        if small:
            inc_b = max(big["merge_mem_kb"], 1)
            inc_s = max(small["merge_mem_kb"], 1)
            ratio = inc_b / inc_s
            out.append(dict(name=f"[{variant}] merge peak-RSS increment (all its processes), large / small trace",
                            value=f"{ratio:.2f} ({_mb(inc_b * 1024)} / {_mb(inc_s * 1024)})",
                            target=f"<= {TARGET_RSS_GROWTH} (streams)",
                            result="PASS" if ratio <= TARGET_RSS_GROWTH else "FAIL"))
    for variant, qs in res["queries"].items():
        out += query_bench.targets(qs, f"[{variant} store] ")
    return out


def write_json(path, res) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=2_000_000, help="span records of the large trace, all ranks")
    p.add_argument("--small-records", type=int, default=None,
                   help="span records of the small trace (default: a quarter of --records)")
    p.add_argument("--repeat-after", type=int, default=None, metavar="K",
                   help=f"synth.py --repeat-after for both traces (default {REPEAT_AFTER} from "
                        f"{REPEAT_FROM_RECORDS:,} records of the large trace, else none)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--reps", type=int, default=3, help="runs of each query (the median is reported)")
    p.add_argument("--fp-spread", choices=["realistic", "wide"], default="realistic",
                   help="per-rank fingerprint statistics of the large trace (see bench/synth.py)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the traces and stores")
    p.add_argument("--reuse", action="store_true",
                   help="with --dir: merge the traces an earlier run kept there (--keep) if made with these options")
    p.add_argument("--profile", choices=["auto", "always", "never"], default="auto",
                   help="cProfile merge_ranks on a smaller trace (auto: when the rate misses its target)")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps of the profiled trace (default: the 4x smaller trace, steps // 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    p.add_argument("--workers", type=int, default=None,
                   help="TENSOR_TRACE_MERGE_WORKERS for the merges (default: the library chooses)")
    p.add_argument("--compare-with", metavar="FILE", default=None,
                   help="a merge.py of another commit: merged side by side as the variant 'before'")
    p.add_argument("--merge-rounds", type=int, default=1,
                   help="merges of each trace per variant, variants interleaved (the median-wall run is reported)")
    p.add_argument("--merge-child", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--merge-module", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    if args.merge_child:
        merge_child(*args.merge_child, args.merge_module)
        return 0

    def log(msg):
        print(msg, flush=True)

    res = dict(header=header(argv), args=vars(args), traces={}, merge={}, queries={})
    h = res["header"]
    log(f"# {h['date']} {h['hostname']} | {h['cpu']} x{h['cpus']} | python {h['python']} torch {h['torch']}"
        f" | git {h['git']}")
    log(f"# {h['command']}")
    log(f"# {h['uptime_before']}")
    # synth.steps_for without importing synth (numpy) here.
    steps = max(1, round(args.records / (args.ranks * RECORDS_PER_STEP)))
    small = max(6, round((args.small_records or args.records // 4) / (args.ranks * RECORDS_PER_STEP)))
    repeat_after = args.repeat_after
    if repeat_after is None and args.records >= REPEAT_FROM_RECORDS:
        repeat_after = REPEAT_AFTER
    root = args.dir or tempfile.mkdtemp(prefix="tt-merge-bench-")
    os.makedirs(root, exist_ok=True)

    def save():
        if args.json:
            write_json(args.json, res)

    try:
        res["parent_rss_before_merges_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sizes = [("small", small), ("large", steps)]
        for label, n in sizes:
            d = os.path.join(root, label)
            # --reuse: the traces of an earlier run with the same options (--keep), e.g. to merge
            # them with another checkout's library (run this script with its interpreter).
            info_path, key = os.path.join(root, f"{label}.info.json"), [n, args.ranks, args.seed, args.fp_spread,
                                                                         repeat_after]
            saved = None
            if args.reuse and os.path.exists(info_path) and os.path.isdir(os.path.join(d, "ranks")):
                with open(info_path) as f:
                    saved = json.load(f)
            if saved is not None and saved.get("key") == key:
                log(f"reusing the {label} trace in {d} (--reuse)")
                res["traces"][label] = saved["info"]
            else:
                log(f"generating {label} trace: {n} steps x {args.ranks} ranks -> {d}")
                res["traces"][label] = generate_in_child(d, n, args.ranks, args.seed, args.fp_spread, repeat_after)
                with open(info_path, "w") as f:
                    json.dump(dict(key=key, info=res["traces"][label]), f)
            g = res["traces"][label]
            log(f"  {g['span_records']:,} span records, {_mb(g['bytes'])}, {g['seconds']:.1f} s")
        large = os.path.join(root, "large")
        variants = [("as-is", None)] + ([("before", os.path.abspath(args.compare_with))] if args.compare_with else [])
        for variant, _ in variants:
            res["merge"][variant] = {}
        for label, _ in sizes:  # small first: RUSAGE_CHILDREN then holds the small merge's peak
            runs = collections.defaultdict(list)
            for r in range(max(1, args.merge_rounds)):
                for variant, module_file in (variants if r % 2 == 0 else variants[::-1]):
                    d = os.path.join(root, label)
                    if variant != "as-is":  # its own store, next to the same rank files
                        d = os.path.join(root, f"{label}-{variant}")
                        os.makedirs(d, exist_ok=True)
                        if not os.path.exists(os.path.join(d, "ranks")):
                            os.symlink(os.path.join(root, label, "ranks"), os.path.join(d, "ranks"))
                        for extra in ("run.json",):
                            if os.path.exists(os.path.join(root, label, extra)):
                                shutil.copy(os.path.join(root, label, extra), d)
                    log(f"merging {label} trace in a child process, {variant} (round {r + 1}) ...")
                    m = merge_in_child(d, module_file, args.workers)
                    g = res["traces"][label]
                    m["rate"] = g["span_records"] / m["wall_s"]
                    m["module_rate"] = g["spans"] / m["wall_s"]
                    runs[variant].append(m)
                    ws = m.get("workers") or []
                    log(f"  wall {m['wall_s']:.2f} s, cpu {m['cpu_s']:.2f} s"
                        + (f" (+ workers {sum(w['cpu_s'] for w in ws):.2f} s)" if ws else "")
                        + f", {m['rate']:,.0f} span records/s, "
                        f"peak RSS {_mb(m['rss_peak_kb'] * 1024)} (VmHWM {_mb(m['vmhwm_kb'] * 1024)}, after imports "
                        f"{_mb(m['vmrss_after_import_kb'] * 1024)}"
                        + (f"; workers' VmHWM {', '.join(_mb((w.get('peak_rss_kb') or 0) * 1024) for w in ws)}"
                           if ws else "")
                        + f"), RUSAGE_CHILDREN {_mb(m['rss_children_kb'] * 1024)}, store {_mb(m['store_bytes'])}")
                    cp = m.get("critical_path")
                    if cp:
                        log(f"  critical path from CPU times (dedicated cores): {cp['wall_s']:.2f} s, "
                            f"{g['span_records'] / cp['wall_s']:,.0f} span records/s (own rank files "
                            f"{cp['own_loads_s']:.2f} s, copying parts {cp['copies_s']:.2f} s, after the loading "
                            f"{cp['after_loading_s']:.2f} s)")
                    log("  phases: " + "; ".join(f"{k} {v:.2f} s" for k, v in m["phases"].items()))
                    log("  VmHWM after phase: " + "; ".join(f"{k} {_mb(v * 1024)}" for k, v in m["vmhwm_after_phase_kb"].items()))
                    log(f"  rows: {m['counts']} (expected {expected_counts(g)}): {_complete(m, g)[1]}")
            for variant, ms in runs.items():
                chosen = sorted(ms, key=lambda m: m["wall_s"])[len(ms) // 2]
                chosen["walls"] = [m["wall_s"] for m in ms]
                res["merge"][variant][label] = chosen
            save()
        rank_file = sorted(os.listdir(os.path.join(large, "ranks")))[0]
        log(f"floor: decoding and inserting {rank_file} alone, in a child process ...")
        res["floor"] = floor_in_child(os.path.join(large, "ranks", rank_file))
        res["floor"]["rate"] = merge_floor.floor_rate(res["floor"], res["header"]["cpus"])
        log(f"  {res['floor']['us_per_span_record']:.2f} µs a span record: {res['floor']['rate']:,.0f} span records/s "
            f"on {res['header']['cpus']} cores")
        save()
        # the store now in place is the library's merge of the large trace
        log(f"queries against the as-is store of {large} ({args.reps} runs each, CliRunner in a child process):")
        res["queries"]["as-is"] = query_bench.queries_in_child(large, args.reps)
        save()
        rates = [res["merge"]["as-is"]["large"]["rate"]]
        if args.profile == "always" or (args.profile == "auto" and min(rates) < TARGET_RATE):
            if args.profile_steps:
                n = args.profile_steps
                d = os.path.join(root, "profile")
                generate_in_child(d, n, args.ranks, args.seed, args.fp_spread, None)
            else:
                n, d = sizes[0][1], os.path.join(root, "small")
            log(f"cProfile of merge_ranks  on a {n}-step trace ...")
            res["profile"] = dict(steps=n, span_records=n * args.ranks * RECORDS_PER_STEP, **merge_profile.profile_merge(d))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        elif not args.keep:
            for sub in ("small", "large", "small-before", "large-before", "profile"):
                shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    h["uptime_after"] = load_summary()
    res["targets"] = targets(res)
    print_table(res)
    if "profile" in res:
        print(merge_profile.text(res["profile"]))
    failed = [t["name"] for t in res["targets"] if t["result"] == "FAIL"]
    print(f"\ntargets: {len(res['targets']) - len(failed)} PASS, {len(failed)} FAIL"
          + (": " + "; ".join(failed) if failed else ""))
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
