"""tensor-trace: distributed tensor tracing for tensor-parallel LLM inference.

Subpackages:
- ``tensor_trace.tracer`` runs inside every traced process (hooks, collectives, rank files).
- ``tensor_trace.exporters`` runs afterwards (read rank files, merge, query, export).
- ``tensor_trace.schema`` is the only module both sides share.

For notebooks and scripts (``tensor_trace.api``)::

    t = tensor_trace.open("tensor-trace-out")      # a recorded trace folder
    t.points("model.layers.0.*"); t.reduction("model.embed_tokens"); t.compare("other-run")
    with tensor_trace.trace(out_dir="my-trace"):   # trace a block of this process
        model(x)
"""

__version__ = "0.1.0"


def open(trace_dir: str = "tensor-trace-out"):  # noqa: A001 - the API's name
    """Open a recorded trace folder: a ``tensor_trace.api.Trace``."""
    from tensor_trace import api

    return api.open(trace_dir)


def trace(out_dir: str = "tensor-trace-out", **options):
    """``with tensor_trace.trace(out_dir=...):`` traces the block (``tensor_trace.api.trace``)."""
    from tensor_trace import api

    return api.trace(out_dir, **options)
