"""tensor-trace: distributed tensor tracing for tensor-parallel LLM inference.

Subpackages:
- ``tensor_trace.tracer`` runs inside every traced process (hooks, collectives, rank files).
- ``tensor_trace.exporters`` runs afterwards (read rank files, merge, query, export).
- ``tensor_trace.schema`` is the only module both sides share.
"""

__version__ = "0.1.0"
