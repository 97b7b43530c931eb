"""CUDA-graph replays: counted and announced, since they run no Python hook.

A replay launches the kernels captured earlier and runs none of the forward hooks, so a replayed
step leaves no span. The step that was captured is recorded once, its spans marked captured
(``FLAG_CAPTURED``) and without fingerprints (nothing may synchronise or allocate during a
capture). Every replay is counted (``graph_replays`` in the END record and in the summary), and
the first one prints a one-line warning that says how to trace every step instead.
"""

from __future__ import annotations

import functools
import sys

WARNING = ("tensor-trace: CUDA-graph replays are not traced (forward hooks do not run in a replay); "
           "the captured step is recorded once, marked captured. To trace every step, run without "
           "CUDA graphs (SGLang: --disable-cuda-graph).\n")


class GraphReplayCounter:
    """Wraps ``torch.cuda.CUDAGraph.replay`` for one Tracer."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.orig = None
        self.warned = False

    def install(self) -> None:
        try:
            import torch

            cls = torch.cuda.CUDAGraph
        except Exception:
            return
        orig = cls.__dict__.get("replay")
        if orig is None or getattr(orig, "__tensor_trace_original__", None) is not None:
            return
        counter = self

        @functools.wraps(orig)
        def replay(graph, *args, **kwargs):
            counter.count()
            return orig(graph, *args, **kwargs)

        replay.__tensor_trace_original__ = orig
        self.orig = orig
        cls.replay = replay

    def count(self) -> None:
        try:
            stats = self.tracer.stats
            stats["graph_replays"] = stats.get("graph_replays", 0) + 1
            if not self.warned and self.tracer.enabled:
                self.warned = True
                sys.stderr.write(WARNING)
        except Exception:
            pass

    def uninstall(self) -> None:
        if self.orig is None:
            return
        try:
            import torch

            torch.cuda.CUDAGraph.replay = self.orig
        except Exception:
            pass
        self.orig = None
