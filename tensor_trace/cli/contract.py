"""tensor-trace contract save|check: keep a capture point's lineage from changing unnoticed."""

from __future__ import annotations

import json

import click

from tensor_trace.cli.options import json_option, open_trace, trace_option
from tensor_trace.cli.table import echo_json


@click.group()
def contract():
    """Capture contracts: save a point's lineage, check a trace against it."""


@contract.command()
@click.argument("point")
@click.option("-o", "--output", "out", required=True, metavar="FILE.json", help="Where to write the contract.")
@trace_option
def save(point, out, trace_dir):
    """Write POINT's lineage (sources in order, modules, shapes per rank, dtypes, placements)."""
    c = open_trace(trace_dir).contract(point)
    with open(out, "w") as f:
        json.dump(c, f, indent=1)
    click.echo(f"wrote {out}: {c['point']} = {c['op'] or 'no recorded op'} of "
               f"[{', '.join(s['point'] for s in c['sources'])}]")


@contract.command()
@click.argument("contract_file", metavar="FILE.json")
@trace_option
@json_option
def check(contract_file, trace_dir, as_json):
    """Compare a trace with a contract; exit 1 with the list of mismatches."""
    from tensor_trace.exporters.analysis import lineage as lin

    c = lin.load_contract(contract_file)
    res = open_trace(trace_dir).lineage(c["point"])
    problems = lin.compare(c, res)
    if as_json:
        echo_json(dict(point=c["point"], ok=not problems, mismatches=problems,
                       expected=[s["point"] for s in c["sources"]], actual=[s["point"] for s in res["sources"]]))
    elif problems:
        click.echo(f"{c['point']}: {len(problems)} mismatch(es) with {contract_file}")
        click.echo(f"  contract: {c['op']} of [{', '.join(s['point'] for s in c['sources'])}]")
        click.echo(f"  trace:    {res['op']} of [{', '.join(s['point'] for s in res['sources'])}]")
        for m in problems:
            click.echo(f"  - {m['message']}")
    else:
        click.echo(f"{c['point']}: matches {contract_file} ({len(c['sources'])} sources)")
    if problems:
        raise SystemExit(1)
