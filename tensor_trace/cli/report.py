"""tensor-trace report [--trace DIR] [-o FILE.html] [--compare DIR_B]"""

from __future__ import annotations

import click

from tensor_trace.cli.options import open_trace, quiet_option, trace_option


@click.command()
@trace_option
@click.option("-o", "--out", default=None, metavar="FILE.html", help="Output file (default DIR/report.html).")
@click.option("--compare", "compare_dir", default=None, metavar="DIR_B",
              help="Also compare with this trace and highlight the first divergence on the map.")
@quiet_option
def report(trace_dir, out, compare_dir, quiet):
    """One self-contained HTML page (no network needed to open it): the placement map (layers x
    point kinds, coloured by placement, pre/post-reduction marked), collectives per layer and op,
    check's findings, run facts, and with --compare the comparison with a second trace."""
    from tensor_trace import progress

    progress.set_quiet(quiet)
    r = open_trace(trace_dir).report(out, compare_dir)
    click.echo(f"wrote {r['path']} ({r['bytes']:,} bytes): {r['layers']} layers, {r['points']} points, "
               f"{r['findings']} finding(s)")
