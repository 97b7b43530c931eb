"""The interface every exporter implements, in the OpenTelemetry SDK's style.

An exporter receives batches of spans read from a merged store (``export``), may buffer them,
and is flushed (``force_flush``) and closed (``shutdown``) by its caller. It never raises into
the caller for a transient failure: it returns ``ExportResult.FAILURE`` and says why once.
"""

from __future__ import annotations

import enum


class ExportResult(enum.Enum):
    SUCCESS = 0
    FAILURE = 1


class SpanExporter:
    """Base class: ``export(batch) -> ExportResult``, ``force_flush(timeout_s) -> bool``,
    ``shutdown()``."""

    def export(self, batch) -> ExportResult:  # pragma: no cover - interface
        raise NotImplementedError

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        return None
