"""tensor-trace merge [DIR]"""

import click

from tensor_trace.cli.report import quiet_option


@click.command()
@click.argument("trace_dir", default="tensor-trace-out", required=False)
@quiet_option
def merge(trace_dir, quiet):
    """Merge the rank files of DIR into one indexed store (DIR/merged.sqlite)."""
    import tensor_trace
    from tensor_trace import progress
    from tensor_trace.exporters.pipeline import store_path

    progress.set_quiet(quiet)
    report = tensor_trace.open(trace_dir).merge()
    click.echo(f"merged {report['processes']} rank file(s), {report['points']} capture points -> "
               f"{store_path(trace_dir)}")
    for off in report["clocks"]:
        proc, offset, resid, n = off
        if offset or resid:
            click.echo(f"  clock: process {proc} offset {offset / 1e6:+.3f} ms"
                       + (f", residual skew {resid / 1e6:.3f} ms over {n} collectives" if resid is not None else ""))
    for issue in report["collective_issues"]:
        click.echo(f"  collective mismatch: {issue[4]}")
