"""CUDA-graph replays against eager steps of the same inputs (issue "Trace CUDA-graph replays").

    python bench/graph_check.py --eager E_DIR --graph G_DIR --plain-out P.json --traced-out T.json

E_DIR: the example recorded eagerly; G_DIR: the example recorded with ``--cuda-graph`` (step 0
eager warm-up, step 1 the capture, steps 2.. replays of example steps 1..); P.json / T.json:
the example's ``--out`` of an untraced and of the traced ``--cuda-graph`` run. Checks, for every
replayed step:

1. fingerprints of every point equal the eager step's of the same input, within the
   tolerance of exporters/analysis/tolerance.py (printed);
2. the graph's outputs are bitwise the same with tracing on as without (sha256 of the logits
   and of the draft output, per step);
3. placement and reduction verdicts equal the eager step's, point by point.

Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import json
import sys

from tensor_trace.exporters.analysis import tolerance as pl
from tensor_trace.exporters import query as q
from tensor_trace.exporters.pipeline import open_store


def per_step(con, step) -> dict:
    return {p["point"]: p for p in q.placement(con, "*:*", step=step)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eager", required=True)
    ap.add_argument("--graph", required=True)
    ap.add_argument("--plain-out", required=True)
    ap.add_argument("--traced-out", required=True)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    ce, cg = open_store(args.eager), open_store(args.graph)
    steps = [(s, json.loads(a or "{}")) for s, a in cg.execute(
        "SELECT DISTINCT step, attrs FROM steps ORDER BY step")]
    replays = [(s, a["replay_of"]) for s, a in steps if a.get("replay_of") is not None]
    captured = [s for s, a in steps if a.get("captured")]
    ok = bool(replays)
    report = dict(replayed_steps=len(replays), captured_steps=captured, steps=[])
    print(f"graph run: {len(steps)} steps, captured {captured}, {len(replays)} replays "
          f"(of step {sorted({c for _, c in replays})})")
    fp_total = fp_equal = fp_missing = verdict_total = verdict_same = 0
    for gstep, _cap in replays:
        estep = gstep - 1  # example step k is graph-run step k + 1 (step 1 is the capture)
        e, g = per_step(ce, estep), per_step(cg, gstep)
        if e.keys() != g.keys():
            print(f"  step {gstep}: points differ from eager step {estep}: "
                  f"{sorted(e.keys() ^ g.keys())[:5]}")
            ok = False
        bad_fp, bad_v = [], []
        for name in sorted(e.keys() & g.keys()):
            x, y = e[name], g[name]
            verdict_total += 1
            if (x["placement"], x["reduction"]) == (y["placement"], y["reduction"]):
                verdict_same += 1
            else:
                bad_v.append(f"{name}: {x['placement']}/{x['reduction']} vs {y['placement']}/{y['reduction']}")
            fx, fy = x.get("fingerprint"), y.get("fingerprint")
            fp_total += 1
            if fx is None or fy is None:
                fp_missing += 1
                bad_fp.append(f"{name}: no fingerprint ({'eager' if fx is None else 'replay'})")
                continue
            shape = next(iter(x["shapes"].values()))
            dtype = x.get("dtype") or "bfloat16"
            if pl.fp_equal(pl.Observed(shape, dtype, tuple(fx)), pl.Observed(shape, dtype, tuple(fy))):
                fp_equal += 1
            else:
                bad_fp.append(f"{name}: eager {fx} replay {fy}")
        report["steps"].append(dict(graph_step=gstep, eager_step=estep, points=len(g),
                                    fingerprint_mismatches=bad_fp, verdict_mismatches=bad_v))
        print(f"  replay step {gstep} vs eager step {estep}: {len(g)} points, "
              f"{len(g) - len(bad_fp)} fingerprints equal, {len(g) - len(bad_v)} verdicts equal")
        for line in (bad_fp + bad_v)[:6]:
            print(f"    {line}")
        ok = ok and not bad_fp and not bad_v
    dtypes = sorted({v for (v,) in cg.execute("SELECT DISTINCT dtype FROM points") if v in pl.EPS})
    print(f"fingerprints: {fp_equal} of {fp_total} equal ({fp_missing} missing); tolerance: sums agree when "
          f"|a-b| <= eps*sqrt(sumsq) + 2**-20*sqrt(n*sumsq), eps " + ", ".join(f"{d} {pl.eps(d):g}" for d in dtypes))
    print(f"verdicts: {verdict_same} of {verdict_total} equal")
    with open(args.plain_out) as f:
        plain = json.load(f)["steps"]
    with open(args.traced_out) as f:
        traced = json.load(f)["steps"]
    same = [p["logits_sha256"] == t["logits_sha256"] and p["draft_sha256"] == t["draft_sha256"]
            for p, t in zip(plain, traced)]
    print(f"outputs bitwise unchanged with tracing on: {sum(same)} of {len(same)} steps "
          f"(sha256 of logits and draft output; steps 1.. are replays)")
    ok = ok and len(same) == len(plain) == len(traced) and all(same)
    report.update(fingerprints_equal=fp_equal, fingerprints=fp_total, verdicts_equal=verdict_same,
                  verdicts=verdict_total, outputs_identical=sum(same), output_steps=len(same), ok=ok)
    print("GRAPH REPLAYS MATCH EAGER" if ok else "GRAPH REPLAYS DIFFER")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
