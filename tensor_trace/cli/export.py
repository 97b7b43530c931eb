"""tensor-trace export perfetto [--trace DIR] [-o FILE]"""

import click


@click.group()
def export():
    """Write a trace for other tools."""


@export.command()
@click.option("--trace", "trace_dir", default="tensor-trace-out", show_default=True, help="Trace folder.")
@click.option("-o", "--out", default=None, help="Output file (default DIR/trace.perfetto.json.gz; .gz compresses).")
def perfetto(trace_dir, out):
    """Chrome trace-event JSON of all ranks on one aligned timeline (Perfetto UI, chrome://tracing)."""
    from tensor_trace.exporters.perfetto import export_perfetto

    r = export_perfetto(trace_dir, out)
    click.echo(f"wrote {r['events']:,} events ({r['bytes']:,} bytes) to {r['path']}: open it in https://ui.perfetto.dev")
