"""CUDA graphs: a traced forward captured into a graph makes every replay a traced step.

Forward hooks run while a graph is captured, never while it is replayed. So the tracer does
its work at capture time and leaves the rest to the graph:

- *Capture* (``CUDAGraph.capture_begin`` .. ``capture_end``, which ``torch.cuda.graph`` and
  SGLang's graph runner use): the step is recorded once, as usual, its spans marked captured
  (``FLAG_CAPTURED``): module paths, shapes, dtypes, collectives with their groups. Its
  fingerprints are not computed then (a capture executes nothing): the fingerprint kernels are
  appended to the graph instead: one multi-tensor kernel per dtype reading the tensors in place
  (tracer/multi_tensor.py; tensors of one shape stacked and reduced together where Triton is
  missing), in buckets of at most ``GRAPH_DEFER_BYTES`` held tensors (so the extra graph-pool
  memory is bounded), and all values gathered into one static ``[n, 2]`` fp32 buffer. That
  buffer and the kernels' address tables live as long as the graph (an attribute of it), since
  the graph rewrites and reads them at every replay, traced or not.
- *Replay* (``CUDAGraph.replay``): a replay of such a graph is recorded as a step (or, inside a
  framework's own step such as SGLang's ``ModelRunner.forward``, as part of it): which capture
  it replays, host time, device time from two CUDA events, and, on a step the fingerprint
  schedule picks, the static buffer copied to pinned host memory without waiting, read once its
  event has completed. On the other replays the kernels are gated off (multi_tensor's
  ``ReplayGate``: one int on the device that they read first), so they read no tensor. The merge gives the
  replayed step the captured step's spans with the replay's fingerprints, so placement and
  reduction are judged as for an eager step.

Not traced in graph mode: module timings inside a replay (a replay is one launch; its spans
keep the captured step's order, not measured times); a graph captured while tracing was off or
outside the ``--steps`` window (its replays are counted, and the first prints a warning); tensors
a graph reads that no module boundary shows.
"""

from __future__ import annotations

import sys
import weakref

from tensor_trace.tracer.patching import wrap_method

WARNING = ("tensor-trace: a CUDA graph captured without tracing is being replayed: its replays are "
           "counted, not traced (trace the capture, e.g. keep SGLang's graph capture inside the "
           "--steps window, or run without CUDA graphs: SGLang --disable-cuda-graph).\n")


def _cuda_graph_cls():
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.CUDAGraph
    except Exception:
        return None


class CapturedStep:
    """One traced step captured into a graph: its step number and fingerprint buffer."""

    __slots__ = ("step", "root", "attrs", "n_spans", "n_colls", "fps")

    def __init__(self, step, root, attrs, n_spans, n_colls, fps):
        self.step, self.root, self.attrs = step, root, attrs
        self.n_spans, self.n_colls, self.fps = n_spans, n_colls, fps


class GraphTracker:
    """Wraps ``CUDAGraph.capture_begin``, ``capture_end`` and ``replay`` for one Tracer.

    ``graph_cls`` defaults to ``torch.cuda.CUDAGraph`` as found at install time (tests put a
    stand-in class with the same three methods there to exercise the bookkeeping on a CPU)."""

    def __init__(self, tracer, graph_cls=None):
        self.tracer = tracer
        self.graph_cls = graph_cls
        self.origs: dict = {}
        self.warned = False
        self.capturing = None  # the graph being captured (a weak reference)
        self.pending: list = []  # CapturedStep of the capture in progress
        self.graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def install(self) -> None:
        cls = self.graph_cls
        if cls is None:
            try:
                import torch

                cls = torch.cuda.CUDAGraph
            except Exception:
                return
            self.graph_cls = cls
        for name, make in (("capture_begin", self._wrap_begin), ("capture_end", self._wrap_end),
                           ("replay", self._wrap_replay)):
            orig = wrap_method(cls, name, make)
            if orig is not None:
                self.origs[name] = orig

    def uninstall(self) -> None:
        try:  # a replay after this point is not wrapped: order the tables' copies before it
            # now, and let its fingerprint kernels read nothing (no one reads their values)
            for captured in list(self.graphs.values()):
                for c in captured:
                    if c.fps is not None:
                        c.fps.before_replay()
                        c.fps.read_at_replay(False)
        except Exception:
            pass
        for name, orig in self.origs.items():
            try:
                setattr(self.graph_cls, name, orig)
            except Exception:
                pass
        self.origs = {}

    # ------------------------------------------------------------------ wrappers
    def _wrap_begin(self, orig):
        tracker = self

        def capture_begin(graph, *args, **kwargs):
            tracker.warm_up()
            try:
                result = orig(graph, *args, **kwargs)
            except BaseException:
                tracker.end_arena()
                raise
            try:
                tracker.capturing = weakref.ref(graph)
                tracker.pending = []
            except Exception:
                tracker.capturing = None
            return result

        return capture_begin

    def _wrap_end(self, orig):
        tracker = self

        def capture_end(graph, *args, **kwargs):
            result = orig(graph, *args, **kwargs)
            try:
                if tracker.pending:
                    keep = [c.fps for c in tracker.pending if c.fps is not None]
                    for fps in keep:
                        fps.prepare()
                    if keep:
                        # The graph's kernels write the static buffer and read the tables at
                        # every replay, traced or not, also after the tracer has stopped: they
                        # live as long as the graph (freed, their graph-pool memory could be
                        # handed to another capture sharing the pool).
                        try:
                            graph._tensor_trace_buffers = keep
                        except AttributeError:
                            pass
                    tracker.graphs[graph] = tracker.pending
            except Exception as exc:
                tracker.tracer.on_error("graph capture end", exc)
            tracker.pending = []
            tracker.capturing = None
            tracker.end_arena()
            return result

        return capture_end

    def _wrap_replay(self, orig):
        tracker = self

        def replay(graph, *args, **kwargs):
            tracer = tracker.tracer
            try:
                captured = tracker.graphs.get(graph) if tracker.graphs else None
            except TypeError:  # not a graph object we could have captured
                captured = None
            untraced = captured is None or not tracer.enabled
            for fps in getattr(graph, "_tensor_trace_buffers", ()):
                try:
                    fps.before_replay()
                    if untraced:
                        fps.read_at_replay(False)
                except Exception as exc:
                    tracer.on_error("graph replay", exc)
            if untraced:
                tracker.count_untraced()
                return orig(graph, *args, **kwargs)
            return tracer.run_replay(captured, orig, graph, *args, **kwargs)

        return replay

    # ------------------------------------------------------------------ bookkeeping
    def warm_up(self) -> None:
        """Before a capture: compile the fingerprint kernel (compiling must not happen inside a
        capture) and allocate the capture's table arena outside the graph's pool."""
        tracer = self.tracer
        if not (tracer.enabled and tracer.fingerprint) or self.graph_cls is not _cuda_graph_cls():
            return
        try:
            import torch

            if not torch.cuda.is_available():  # a stand-in graph class on a CPU (tests)
                return

            from tensor_trace.tracer import multi_tensor

            device = torch.device("cuda", torch.cuda.current_device())
            if multi_tensor.warm_up(device):
                multi_tensor.begin_capture(device)  # the capture's kernel tables live there
        except Exception as exc:
            tracer.on_error("fingerprint kernel warm-up", exc)

    def end_arena(self) -> None:
        mt = sys.modules.get("tensor_trace.tracer.multi_tensor")
        if mt is not None:
            mt.end_capture()

    def add_captured(self, captured: CapturedStep) -> None:
        """A traced step ended while a graph was being captured: its replays will be traced."""
        self.pending.append(captured)

    def count_untraced(self) -> None:
        try:
            stats = self.tracer.stats
            stats["graph_replays_untraced"] = stats.get("graph_replays_untraced", 0) + 1
            if not self.warned and self.tracer.enabled:
                self.warned = True
                sys.stderr.write(WARNING)
        except Exception:
            pass
