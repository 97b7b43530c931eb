"""tensor-trace check [--trace DIR]: what one trace shows wrong by itself."""

from __future__ import annotations

import click

from tensor_trace.cli.options import json_option, open_trace, trace_option
from tensor_trace.cli.table import echo_json


@click.command()
@trace_option
@json_option
def check(trace_dir, as_json):
    """Findings that need no second run: double reductions, all_reduces that gather, reductions
    outside the TP group, partial sums captured before their reduction, points divergent across
    ranks, collectives skipped or mismatched. Exit 1 when there are any."""
    findings = open_trace(trace_dir).check()
    if as_json:
        echo_json(findings)
    elif not findings:
        click.echo("no findings")
    else:
        click.echo(f"{len(findings)} finding(s):")
        for f in findings:
            c = f["collective"]
            where = f" [{c.get('op')} #{c.get('seq')} of group {c.get('group')} {c.get('group_ranks')}]" if c else ""
            click.echo(f"{f['kind']}: {f['point'] or '-'}{where}")
            click.echo(f"  {f['detail']}")
            for e in f["evidence"]:
                click.echo(f"  - {e}")
    if findings:
        raise SystemExit(1)
