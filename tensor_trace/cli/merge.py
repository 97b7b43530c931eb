"""tensor-trace merge [DIR [DIR_NODE1 ...]]"""

import click

from tensor_trace.cli.options import quiet_option


@click.command()
@click.argument("trace_dir", default="tensor-trace-out", required=False)
@click.argument("node_dirs", nargs=-1)
@quiet_option
def merge(trace_dir, node_dirs, quiet):
    """Merge the rank files of DIR into one indexed store (DIR/merged.sqlite).

    With more folders (the nodes of one multi-node run, recorded with the same --run-id), their
    rank files are first gathered into DIR/ranks, so the store and queries over DIR see every node."""
    import tensor_trace
    from tensor_trace import progress
    from tensor_trace.exporters.pipeline import store_path
    from tensor_trace.exporters.store.nodes import gather_nodes

    progress.set_quiet(quiet)
    if node_dirs:
        added = gather_nodes(trace_dir, list(node_dirs))
        click.echo(f"gathered {added} rank file(s) of {len(node_dirs)} other node folder(s) into {trace_dir}/ranks")
    report = tensor_trace.open(trace_dir).merge()
    click.echo(f"merged {report['processes']} rank file(s), {report['points']} capture points -> "
               f"{store_path(trace_dir)}")
    hosts = report.get("hosts", [])
    if len(hosts) > 1:
        click.echo(f"  hosts: {', '.join(hosts)}")
    for off in report["clocks"]:
        proc, offset, resid, n = off
        if offset or resid:
            click.echo(f"  clock: process {proc} offset {offset / 1e6:+.3f} ms"
                       + (f", residual skew {resid / 1e6:.3f} ms over {n} collectives" if resid is not None else ""))
    for issue in report["collective_issues"]:
        click.echo(f"  collective mismatch: {issue[4]}")
