"""The in-process side of tensor-trace: hooks, collective interception and rank files.

Usually started for you by ``tensor-trace record -- CMD`` (through the bootstrap
``sitecustomize``). To trace from your own code::

    from tensor_trace import tracer
    tracer.start(out_dir="trace-out")
    ...  # run the model
    tracer.stop()

This package never imports ``tensor_trace.exporters``. torch is imported only when tracing
starts.
"""

from __future__ import annotations

_current = None


def start(config=None, **options):
    """Start tracing this process; returns the Tracer. ``options`` are TraceConfig fields."""
    global _current
    from tensor_trace.tracer.config import TraceConfig
    from tensor_trace.tracer.core import Tracer

    if _current is not None and _current.enabled:
        return _current
    if config is None:
        config = TraceConfig(**options)
    if not config.run_id:
        import uuid

        config.run_id = uuid.uuid4().hex[:16]
    _current = Tracer(config).start()
    return _current


def stop(reason: str = "stop") -> None:
    """Stop tracing: remove every hook, flush and close the rank file."""
    global _current
    if _current is not None:
        _current.stop(reason)
        _current = None


def current():
    """The running Tracer of this process, or None."""
    return _current


def set_tp_group(group=None, ranks=None, name: str = "tp") -> None:
    """Tell the tracer which process group is this process's tensor-parallel group."""
    if _current is not None:
        _current.set_tp_group(group, ranks, name)


def set_step_attrs(**attrs) -> None:
    """Attributes written with the next steps (forward mode, batch size, ...); None clears."""
    if _current is not None:
        _current.step_attrs = {k: v for k, v in attrs.items() if v is not None} or None
