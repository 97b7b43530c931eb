"""tensor-trace export perfetto [--trace DIR] [-o FILE]"""

import click

from tensor_trace.cli.options import quiet_option


@click.group()
def export():
    """Write a trace for other tools."""


@export.command()
@click.option("--trace", "trace_dir", default="tensor-trace-out", show_default=True, help="Trace folder.")
@click.option("-o", "--out", default=None, help="Output file (default DIR/trace.perfetto.json.gz; .gz compresses).")
@quiet_option
def perfetto(trace_dir, out, quiet):
    """Chrome trace-event JSON of all ranks on one aligned timeline (Perfetto UI, chrome://tracing)."""
    import tensor_trace
    from tensor_trace import progress

    progress.set_quiet(quiet)
    r = tensor_trace.open(trace_dir).export_perfetto(out)
    click.echo(f"wrote {r['events']:,} events ({r['bytes']:,} bytes) to {r['path']}: open it in https://ui.perfetto.dev")


@export.command()
@click.option("--endpoint", default=None, help="OTLP endpoint, e.g. http://127.0.0.1:4317 (gRPC) or "
              "http://127.0.0.1:4318 (HTTP; /v1/traces is added when no path is given). Default: "
              "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT.")
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--trace", "trace_dir", default="tensor-trace-out", show_default=True, help="Trace folder.")
@quiet_option
def otlp(endpoint, protocol, trace_dir, quiet):
    """Send the trace to an OpenTelemetry backend: a resource per rank, a trace per step.
    OTEL_EXPORTER_OTLP_* variables (headers, timeout, compression) apply."""
    import os

    import tensor_trace
    from tensor_trace import progress
    from tensor_trace.errors import BadInput

    endpoint = (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not endpoint:
        raise BadInput("export otlp needs --endpoint URL (or OTEL_EXPORTER_OTLP_ENDPOINT)")
    progress.set_quiet(quiet)
    r = tensor_trace.open(trace_dir).export_otlp(endpoint, protocol)
    click.echo(f"sent {r['spans']:,} spans to {r['endpoint']} over {r['protocol']}")
