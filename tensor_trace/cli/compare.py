"""tensor-trace compare DIR_A DIR_B [PATTERN] [--steps ...]: where do two runs part?"""

from __future__ import annotations

import click

from tensor_trace.cli.options import json_option, open_trace, quiet_option
from tensor_trace.cli.table import echo_json, echo_table


@click.command()
@click.argument("dir_a")
@click.argument("dir_b")
@click.argument("pattern", required=False)
@click.option("--steps", "steps", multiple=True, metavar="A:B[,...]",
              help="Pair step A of DIR_A with step B of DIR_B (N: step N of both; A0-A1:B0: a run of "
                   "steps). Default: steps paired by kind (forward mode and tokens), else in order.")
@json_option
@quiet_option
def compare(dir_a, dir_b, pattern, steps, as_json, quiet):
    """Compare two traces point by point (any TP sizes): the first point that differs beyond
    the tolerance, then every point's status. Exit 1 when the runs differ."""
    from tensor_trace import progress
    from tensor_trace.exporters.analysis.compare import DIFFERS

    progress.set_quiet(quiet)
    res = open_trace(dir_a).compare(dir_b, pattern, steps)
    if as_json:
        echo_json(res)
    else:
        echo_compare(res)
    if any(p["status"] == DIFFERS for p in res["points"]):
        raise SystemExit(1)


def echo_compare(res: dict) -> None:
    g, t = res["groups"], res["tolerance"]
    counts: dict = {}
    for p in res["points"]:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    click.echo(f"A: TP {g['a']['size']} (ranks {g['a']['ranks']}), B: TP {g['b']['size']} (ranks {g['b']['ranks']}); "
               f"{len(res['steps'])} step pair(s) compared: "
               + ", ".join(f"A{a}~B{b}" for a, b in res["steps"][:6]) + (" ..." if len(res["steps"]) > 6 else ""))
    skipped = res.get("steps_not_fingerprinted") or []
    if skipped:
        click.echo(f"{len(skipped)} more step pair(s) not compared: not fingerprinted in both runs "
                   f"(structure and shapes compared, values not; record --fingerprint-every 1 for all)")
    un = res["unpaired"]
    if un["a"] or un["b"]:
        click.echo(f"unpaired steps (no step of the same kind in the other run): A {un['a'][:10]}, B {un['b'][:10]}")
    click.echo(f"tolerance: {t['formula']}, order {t['order']:g} ({t['reason']})")
    click.echo(f"{len(res['points'])} points: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    f = res["first_divergence"]
    if f is None:
        click.echo("no divergence beyond the tolerance")
    else:
        click.echo(f"first divergence: {f['point']} (step {f['step_a']} of A, step {f['step_b']} of B)")
        click.echo(f"  {f['detail']}")
        for e in f["evidence"]:
            click.echo(f"  - {e}")
    click.echo("")
    echo_table(["point", "status", "rel error", "tolerance", "placement A", "placement B"],
               [[p["point"], p["status"] + (f" ({p['reason']})" if p.get("reason") else ""),
                 _num(p["rel_error"]), _num(p["tolerance"]), p["placement_a"] or "-", p["placement_b"] or "-"]
                for p in res["points"]])


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"
