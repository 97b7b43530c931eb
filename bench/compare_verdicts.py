"""Compare the placement and reduction verdicts of two traces of the same program, point by point.

    python bench/compare_verdicts.py REFERENCE_DIR OTHER_DIR [--json FILE]

Used to show that a GPU run (NCCL, bf16) gets the same verdicts as the CPU run (gloo) of the
same example and seed. Every point (inputs and outputs of every module call, named captures,
each call of a module called more than once) is compared; the exit status is 1 when any verdict
differs or a point exists in one trace only. Values are not compared: kernels differ across
devices, so fingerprints agree only within rounding, which is what the verdicts already allow
for (the tolerance is printed).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from tensor_trace.exporters.analysis import tolerance as pl
from tensor_trace.exporters.pipeline import open_store


def verdicts(trace_dir: str) -> dict:
    con = open_store(trace_dir)
    rows = con.execute("SELECT point, placement, reduction, shapes, dtype FROM points").fetchall()
    return {p: dict(placement=a, reduction=r, shapes=json.loads(s), dtype=d) for p, a, r, s, d in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    a, b = verdicts(args.reference), verdicts(args.other)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = []
    shapes_differ = 0
    for p in sorted(set(a) & set(b)):
        x, y = a[p], b[p]
        if (x["placement"], x["reduction"]) != (y["placement"], y["reduction"]):
            differ.append(dict(point=p, reference=[x["placement"], x["reduction"]],
                               other=[y["placement"], y["reduction"]]))
        shapes_differ += x["shapes"] != y["shapes"]
    counts = collections.Counter((v["placement"], v["reduction"]) for v in a.values())
    dtypes = sorted({v["dtype"] for v in b.values() if v["dtype"] in pl.EPS})
    print(f"reference {args.reference}: {len(a)} points; other {args.other}: {len(b)} points")
    print("verdicts of the reference: " + ", ".join(f"{k[0]}/{k[1]} {n}" for k, n in counts.most_common()))
    print(f"tolerance (exporters/analysis/tolerance.py): two sums of the same n values agree when "
          f"|a-b| <= eps*sqrt(sumsq) + 2**-20*sqrt(n*sumsq); eps = "
          + ", ".join(f"{d} {pl.eps(d):g}" for d in dtypes))
    print(f"same verdict: {len(a.keys() & b.keys()) - len(differ)} of {len(a.keys() & b.keys())} common points; "
          f"different: {len(differ)}; only in reference: {len(only_a)}; only in other: {len(only_b)}; "
          f"points whose shapes differ: {shapes_differ}")
    for d in differ[:40]:
        print(f"  DIFFERENT {d['point']}: {d['reference'][0]}/{d['reference'][1]} vs {d['other'][0]}/{d['other'][1]}")
    for p in only_a[:10]:
        print(f"  only in reference: {p}")
    for p in only_b[:10]:
        print(f"  only in other: {p}")
    ok = not differ and not only_a and not only_b
    print("VERDICTS IDENTICAL" if ok else "VERDICTS DIFFER")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(reference=args.reference, other=args.other, points=len(a), differ=differ,
                           only_reference=only_a, only_other=only_b, counts={f"{k[0]}/{k[1]}": n for k, n in counts.items()},
                           identical=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
