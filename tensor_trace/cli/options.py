"""The options several commands share, and the trace folder as they open it."""

from __future__ import annotations

import click

trace_option = click.option("--trace", "trace_dir", default="tensor-trace-out", show_default=True,
                            help="Trace folder (merged on demand).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress lines on the terminal.")


def open_trace(trace_dir):
    """The trace folder through the Python API (``tensor_trace.open``), which the commands wrap."""
    import tensor_trace

    return tensor_trace.open(trace_dir)
