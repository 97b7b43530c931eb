"""Tracer: one process's recording state, its lifecycle, identity and errors.

The work is done by module functions that take the tracer first, one module per concern:
tracer/steps.py (when a step begins and ends), tracer/intercept.py (the call wrapper and hook
bodies), tracer/spans.py (SPAN records), tracer/naming.py (module paths, call sites,
parameters), tracer/graph_replay.py (CUDA-graph replays as steps). The state they share lives
here, as public attributes of the Tracer.

Safety. Every hook body is guarded: an exception is counted, reported once on stderr, written
into the trace, and after ``max_errors`` of them tracing turns itself off in the process. A busy
flag stops re-entrance (the tracer's own tensor ops must not be traced).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import weakref

import torch

from tensor_trace import schema
from tensor_trace.tracer import graph_replay, host_values, intercept, naming, native, spans, steps
from tensor_trace.tracer.config import TraceConfig
from tensor_trace.tracer.device_time import CollectiveDeviceTimes
from tensor_trace.tracer.fingerprint import StepFingerprints
from tensor_trace.tracer.writer import RankWriter

_now = time.monotonic_ns


class _ActiveThreadInput:
    """An attribute of Tracer that ``Tracer.active_thread`` depends on: stored as ``_NAME``, and
    every assignment recomputes it (assignments happen off the hot path; hooks read it)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else obj.__dict__[self.slot]

    def __set__(self, obj, value):
        d = obj.__dict__
        d[self.slot] = value
        obj.active_thread = d["_step_thread"] if (d["_tracing_step"] and not d["_busy"]) else 0


class Tracer:
    """Records module spans, collectives and fingerprints of one process into its rank file."""

    # ``active_thread`` folds three tests of every hook call into one: it is the step's thread
    # ident while a traced step runs and the tracer is not busy, else 0 (no thread has ident
    # 0). Setting any of the three attributes it depends on recomputes it.
    active_thread = 0
    busy = _ActiveThreadInput()
    tracing_step = _ActiveThreadInput()
    step_thread = _ActiveThreadInput()

    @property
    def span_count(self) -> int:
        """Spans opened in this step (the next span's index): ``counters``' count, which the hot
        paths read there (tracer/native_counters.py)."""
        return self.counters.span_count

    @span_count.setter
    def span_count(self, value: int) -> None:
        self.counters.span_count = value

    def __init__(self, config: TraceConfig):
        self._busy = self._tracing_step = False
        self._step_thread = 0
        self.config = config
        self.selector = config.module_selector()
        self.fingerprint = config.fingerprint
        self.enabled = False
        self.writer: RankWriter | None = None
        self.layouts = spans.SpanLayouts()  # of the current rank file
        # step state
        self.step = -1
        self.in_step = False  # a root call is open (traced or not)
        self.tracing_step = False  # ... and it is inside the --steps window
        self.capturing = False
        self.step_thread = 0
        self.step_t0 = 0
        self.step_t0_raw = 0
        self.fp_now = False
        self.native_pending = True  # tracer/native.py: asked for at the first step (steps._poll_native)
        self.span_flags = 0
        self.max_spans = config.max_spans_per_step
        self.stack: list = []  # the open calls of the current step (tracer/spans.py: F_*)
        self.counters = spans.StepCounters()  # span_count and each path's calls in the step
        self.coll_count = 0
        self.fps = self._new_fingerprints()
        self.device_times = CollectiveDeviceTimes()
        self.lineage = None  # LineageRecorder, when config.lineage
        self.lineage_steps: dict = {}  # step kind -> traced steps of that kind so far
        self.fp_steps: dict = {}  # the same count, for the fingerprints' schedule
        self.leaf_quiet: list = []  # (leaf module, torch-function-off context) while it runs
        if config.lineage:
            from tensor_trace.tracer.lineage import LineageRecorder

            self.lineage = LineageRecorder(self)
        self.busy = False
        self.in_collective = False
        # modules (tracer/naming.py)
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ids: dict = {}  # id(module) -> entry with its path id in the current rank file
        self.id_refs: dict = {}  # id(module) -> weak reference that drops its entry
        # module held under several paths -> (entry of its first path, entries of all its paths,
        # {id(holder): [(weakref to the holder, the holder's path, entry of the path through
        # it)]}): its call sites
        self.shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.site_paths: dict = {}  # path id -> path, of the call sites named so far
        self.roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The --steps window has closed for good (go_dormant): no hook or wrapper left to run;
        # the roots whose step hooks went with it, hooked again in a forked child.
        self.dormant = False
        self.dormant_roots: weakref.WeakSet = weakref.WeakSet()
        self.root_classes: list = []  # prefixes given to roots, in order (the first has none)
        # (writer, next index) of the module parameters' fingerprints in that rank file: the
        # roots' parameters (an EAGLE-3 target's and its draft's) are numbered on from there
        self.params_fp_next: tuple = (None, 0)
        # interception (tracer/intercept.py)
        self.global_handles: list = []
        self.late_hooks: dict = {}  # id(module) -> its own forward hooks that record its calls (intercept.late_post_hook)
        self.quiet_hooks = False  # the global hooks are the lineage-quiet variants
        self.hook_fns: dict = {}  # quiet -> (pre, post) hook functions
        self.pre_fn = self.post_fn = None  # what the call wrapper calls (plain or quiet)
        # stats and errors
        self.stats = dict(steps=0, steps_skipped=0, spans=0, collectives=0, errors=0,
                          dropped_spans=0, foreign_thread_calls=0)
        self.errors = 0
        self.written_groups: set = set()
        self._reported: set = set()
        self.step_attrs: dict | None = None
        self.step_end_attrs: dict | None = None  # learnt during the step: written with its end
        self.step_root = None
        self.step_frame = None  # the frame running the step root's _call_impl (stale detection)
        self.identity: dict = {}
        self.collectives = None
        self.graphs = None  # GraphTracker: CUDA-graph captures and replays
        self.live = None  # live OTLP sink of the current rank file, when --otlp-endpoint
        self.after_fork_callbacks: list = []
        self.capture_info: dict = {}  # capture point path -> (writer generation, info written)
        self.external_steps = False  # a framework integration delimits steps itself
        self.step_info = ("", "", {})  # (root path, root class, attrs) of the current step
        self._fork_registered = False
        self._stopping = False  # inside stop: errors there are recorded, never stop it again

    def _new_fingerprints(self) -> StepFingerprints:
        cfg = self.config
        mode = cfg.fingerprint_mode
        return StepFingerprints(defer_cuda=mode != "immediate", defer_cpu=mode == "deferred",
                                hold_bytes=cfg.fp_hold_mib << 20, native_mode=cfg.native)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Tracer":
        """Install hooks and collective interception. The rank file is created lazily, at the
        first traced step, so processes that never run a model (launchers, HTTP front ends,
        tokenizer workers) leave no empty files behind."""
        if self.enabled:
            return self
        from tensor_trace.tracer.collectives import CollectiveInterceptor

        self.collectives = CollectiveInterceptor(self)
        self.collectives.install()
        from tensor_trace.tracer import integrations
        from tensor_trace.tracer.cuda_graphs import GraphTracker

        integrations.apply_loaded()
        self.graphs = GraphTracker(self)
        self.graphs.install()
        if not native.enabled(self.config.native):
            # The layout keys are spans' module globals: an earlier session of this process may
            # have taken the extension's. This one follows its own configuration (keys in
            # Python, and so the Python call wrapper), as a fresh process would.
            spans.use_native_keys(None)
            host_values.use_native(None, None, None)
        self.install_interception()
        self.enabled = True
        if not self._fork_registered:
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_parent,
                                after_in_child=self._after_fork_child)
            self._fork_registered = True
        return self

    def ensure_writer(self) -> RankWriter:
        """The rank file of this process, created on first use."""
        if self.writer is None:
            self._open_writer()
        return self.writer

    def _open_writer(self) -> None:
        cfg = self.config
        host = socket.gethostname()
        pid = os.getpid()
        path = os.path.join(cfg.out_dir, "ranks", f"{host}-{pid}{schema.RANK_FILE_SUFFIX}")
        header = dict(format=schema.FORMAT_VERSION, run_id=cfg.run_id, pid=pid, ppid=os.getppid(),
                      host=host, argv=list(sys.argv), mono_ns=self.now(), wall_ns=time.time_ns(),
                      clock_offset_ns=self.absolute(0), torch=torch.__version__,
                      config=dict(modules=cfg.modules, exclude=cfg.exclude, steps=list(cfg.steps),
                                  fingerprint=cfg.fingerprint, fingerprint_every=cfg.fingerprint_every,
                                  fingerprint_first=steps.FINGERPRINT_FIRST))
        self.writer = RankWriter(path, header, flush_interval_s=cfg.flush_interval_s,
                                 idle_flush_s=cfg.idle_flush_s)
        self.layouts = spans.SpanLayouts()
        self.writer.on_forget.append(self._forget_file_ids)
        self.live = None
        if cfg.otlp_endpoint:
            from tensor_trace.tracer.live_otlp import LiveOTLP

            self.live = LiveOTLP(cfg.otlp_endpoint, cfg.run_id, header,
                                 module_every=cfg.otlp_module_every).start()
            self.writer.listeners.append(self.live.offer)
        self.written_groups = set()  # GROUP records are per file
        if self.identity:
            self.writer.add((schema.IDENTITY, dict(self.identity)))
        self.update_identity()

    def _forget_file_ids(self) -> None:
        """The writer forgot its ids (or lost the chunk that defined them): what refers to
        them is defined again on next use."""
        self.layouts.clear()
        self.written_groups = set()

    def absolute(self, raw_ns: int) -> int:
        """A time of this process's monotonic clock as written in the trace. The same here;
        a test shifts it to play a process with a clock of its own (the header says by how
        much: ``absolute(0)``; tests/integration/clock_shift)."""
        return raw_ns

    def now(self) -> int:
        """Now, as written in the trace."""
        return self.absolute(_now())

    def stop(self, reason: str = "stop") -> None:
        """Remove every hook and patch, write the end record and close the rank file."""
        if (not self.enabled and self.writer is None) or self._stopping:
            return
        self._stopping = True
        try:
            self._stop(reason)
        finally:
            self._stopping = False

    def _stop(self, reason: str) -> None:
        self.enabled = False
        if self.writer is not None:
            # What is queued goes to disk before the unhooking, which takes a while in a large
            # model: a stop on Ctrl-C may be cut short by a SIGKILL (a launcher's, a dead
            # parent's PR_SET_PDEATHSIG).
            self.writer.flush()
        self.dormant = False
        self.dormant_roots = weakref.WeakSet()
        self.remove_interception()
        for handles in list(self.roots.values()):
            for h in handles:
                h.remove()
        self.roots = weakref.WeakKeyDictionary()
        if self.collectives is not None:
            self.collectives.uninstall()
        if self.graphs is not None:
            self.graphs.uninstall()
        # Each part guarded: stop runs at exit and on signals, inside the traced program.
        if self.in_step and self.tracing_step and self.writer is not None:
            try:
                steps.end_step(self, error=True)
            except Exception as exc:
                self.on_error("stop", exc)
        if self.lineage is not None and self.lineage.mode is not None:
            # A step that too many errors left open (on_error stops the tracer from inside
            # it): its lineage mode must not stay on the torch function stack of the program.
            try:
                self.lineage.end_step()
            except Exception as exc:
                self.on_error("stop", exc)
        writer = self.writer
        if writer is None:
            return
        for source in (self.fps, self.device_times):
            try:
                for rec in source.collect(wait=True):
                    writer.add(rec)
            except Exception as exc:
                self.on_error("stop", exc)
        self.stats["untimed_collectives"] = self.device_times.dropped
        writer.flush()  # the END record in a chunk of its own: losing it loses nothing else
        if self.live is not None:
            self.stats.update(self.live.shutdown())
            self.live = None
        self.stats["bytes"] = writer.bytes_written
        self.stats["stale_fingerprints"] = self.fps.stale
        # Chunks the file system refused (a full disk): their records are lost, the program
        # went on. Said here, in the chunk that is written last, if it is written at all.
        self.stats["write_errors"] = writer.write_errors
        writer.add((schema.END, dict(reason=reason, stats=dict(self.stats))))
        writer.close()
        self.writer = None

    # ------------------------------------------------------------------ modules and interception
    def install_interception(self) -> None:
        """Intercept every module call (tracer/intercept.py), while steps are traced."""
        intercept.install_global_hooks(self)

    def remove_interception(self) -> None:
        intercept.remove_global_hooks(self)

    def go_dormant(self) -> None:
        """The ``--steps`` window has closed for good (steps only count up): take out all that
        runs on every later step or collective (the roots' step hooks, global interception, the
        collective wrappers), so the rest of the run costs what an untraced one does. Later
        steps go uncounted (``stats["steps_skipped"]`` stops); a forked child, which counts its
        own steps and window, puts it all back (``_after_fork_child``)."""
        if self.dormant or not self.enabled:
            return
        self.dormant = True
        self.stats["dormant_after_step"] = self.step
        self.remove_interception()
        for module, handles in list(self.roots.items()):
            if handles:
                for h in handles:
                    h.remove()
                self.roots[module] = []
                self.dormant_roots.add(module)
        if self.collectives is not None:
            # (a wrapper bound before it was taken out, e.g. a name imported from
            # torch.distributed while it was in, passes calls on: no tracer's collectives)
            self.collectives.uninstall()
            self.collectives = None

    def _wake_after_fork(self) -> None:
        """Undo go_dormant in a forked child: its window starts over."""
        from tensor_trace.tracer.collectives import CollectiveInterceptor

        self.dormant = False
        self.stats.pop("dormant_after_step", None)
        self.collectives = CollectiveInterceptor(self)
        self.collectives.install()
        for module in list(self.dormant_roots):
            if module in self.roots and not self.roots[module]:
                self.roots[module] = steps.hook_root(self, module)
        self.dormant_roots = weakref.WeakSet()
        self.install_interception()  # (as start does: roots first called in the child)

    def use_native_call(self) -> None:
        """tracer/native.py is ready: modules called through the call wrapper's C version, and
        collectives through theirs."""
        make = native.step_counters_class()
        if make is not None and type(self.counters) is not make:  # (what the C wrapper counts in)
            self.counters = spans.counters_in(make, self.counters)
        intercept.use_native_call(self)
        if self.collectives is not None:
            self.collectives.use_native()

    def set_quiet_hooks(self, quiet: bool) -> None:
        """The lineage-quiet hook bodies (a step that records lineage) or the plain ones."""
        intercept.set_quiet_hooks(self, quiet)

    def record_module_attrs(self, root) -> None:
        """Write what a framework integration says of each named module (MODULE_ATTRS)."""
        from tensor_trace.tracer import integrations

        writer = None
        for sub in root.modules():
            entries = naming.entries_of(self, sub)
            attrs = integrations.module_attrs(sub) if entries else None
            if attrs:
                writer = writer or self.ensure_writer()
                for entry in entries:
                    writer.add((schema.MODULE_ATTRS, writer.module(entry[0], entry[1]), attrs))

    def hook_count(self) -> int:
        """How many hooks this tracer holds now (a stopped tracer holds none)."""
        return (len(self.global_handles) + sum(len(h) for h in self.roots.values())
                + sum(len(h) for h in self.late_hooks.values()))

    # ------------------------------------------------------------------ identity
    def update_identity(self, **extra) -> None:
        """Write who this process is: ranks from the environment and torch.distributed."""
        ident = dict(self.identity)
        env = os.environ
        for key, name in (("rank", "RANK"), ("world_size", "WORLD_SIZE"), ("local_rank", "LOCAL_RANK")):
            if env.get(name, "").isdigit() and key not in ident:
                ident[key] = int(env[name])
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                ident["rank"] = dist.get_rank()
                ident["world_size"] = dist.get_world_size()
                ident["backend"] = str(dist.get_backend())
        except Exception:
            pass
        ident.update({k: v for k, v in extra.items() if v is not None})
        if ident != self.identity:
            self.identity = ident
            if self.writer is not None:
                self.writer.add((schema.IDENTITY, dict(ident)))

    def set_tp_group(self, group=None, ranks=None, name: str = "tp") -> None:
        """Declare the tensor-parallel group of this process (frameworks know it; we may not)."""
        import torch.distributed as dist

        if ranks is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(
                range(dist.get_world_size()))
        rank = dist.get_rank() if dist.is_initialized() else self.identity.get("rank", 0)
        tp_rank = ranks.index(rank) if rank in ranks else None
        self.update_identity(tp_rank=tp_rank, tp_size=len(ranks), tp_ranks=list(ranks), tp_group=name)

    # ------------------------------------------------------------------ errors
    def on_error(self, where: str, exc: BaseException) -> None:
        """An exception inside the tracer (``where``: which part): counted, said once per part
        on stderr, written into the trace; past ``max_errors`` tracing stops in this process."""
        self.errors += 1
        self.stats["errors"] = self.errors
        msg = f"{type(exc).__name__}: {exc}"
        if where not in self._reported:
            self._reported.add(where)
            try:
                sys.stderr.write(f"tensor-trace: error in {where} (tracing goes on): {msg}\n")
            except Exception:
                pass
        try:
            if self.writer is not None:
                self.writer.add((schema.ERROR, self.now(), where, msg[:500], self.errors))
        except Exception:
            pass
        if self.errors >= self.config.max_errors and not self._stopping:
            try:
                sys.stderr.write(f"tensor-trace: {self.errors} errors in pid {os.getpid()}: "
                                 "tracing is now off in this process\n")
                self.stack.clear()
                self.tracing_step = False
                self.in_step = False
                self.stop(reason="too many errors")
            except Exception:
                pass

    # ------------------------------------------------------------------ for integrations
    def begin_external_step(self, root, args, attrs=None) -> bool:
        """Start a step whose root a framework calls with ``root.forward(...)`` directly (so the
        root's own hooks never fire). Returns whether a step was started."""
        return steps.begin_external_step(self, root, args, attrs)

    def add_step_attrs(self, **attrs) -> None:
        """Attributes of the current step that a framework learns only after it began (SGLang
        pads a DP-attention batch inside the forward that is the step): written with the step's
        end, over the attributes it began with. Outside a traced step it does nothing."""
        if not self.tracing_step:
            return
        if self.step_end_attrs is None:
            self.step_end_attrs = {}
        self.step_end_attrs.update(attrs)

    def end_external_step(self, root, result, error: bool = False) -> None:
        """End the step ``begin_external_step`` started at ``root``."""
        steps.end_external_step(self, root, result, error)

    def run_external_step(self, root, args, attrs, fn, *fargs, **fkwargs):
        """Call ``fn(*fargs, **fkwargs)`` as one step rooted at ``root`` (a framework's own
        forward entry point); a call that raises, Ctrl-C included, ends the step as failed."""
        started = self.begin_external_step(root, args, attrs)
        try:
            result = fn(*fargs, **fkwargs)
        except BaseException:
            if started:
                self.end_external_step(root, None, error=True)
            raise
        if started:
            self.end_external_step(root, result)
        return result

    def run_replay(self, captured: list, fn, *args, **kwargs):
        """Run ``fn`` (the real ``CUDAGraph.replay``) as a traced replay of ``captured`` steps."""
        return graph_replay.run_replay(self, captured, fn, *args, **kwargs)

    def record_capture(self, name: str, tensor, info: dict | None = None) -> None:
        """Record a named capture point ``capture:NAME`` (a value a framework captures outside
        any module boundary, e.g. EAGLE-3's aux hidden states) as a span inside the current
        call, with ``info`` saying what it is (written once per name and file)."""
        if not self.tracing_step or self.busy or threading.get_ident() != self.step_thread:
            return
        self.busy = True
        try:
            spans.record_capture(self, name, tensor, info)
        except Exception as exc:
            self.on_error("capture", exc)
        finally:
            self.busy = False

    def enclosing_module(self, pattern) -> str | None:
        """Path of the innermost open call whose path matches the compiled regex ``pattern``."""
        return naming.enclosing_module(self, pattern)

    def innermost_span(self) -> int:
        """Index of the innermost recorded module call, or -1."""
        return spans.innermost_span(self)

    # ------------------------------------------------------------------ fork
    def _before_fork(self) -> None:
        if self.writer is not None:
            self.writer.before_fork()

    def _after_fork_parent(self) -> None:
        if self.writer is not None:
            self.writer.after_fork_in_parent()

    def _after_fork_child(self) -> None:
        # A forked child is a new process with its own rank file; the parent's open step,
        # buffer and flush thread stay with the parent.
        try:
            if self.writer is not None:
                self.writer.abandon_after_fork()
                self.writer = None
            self.stack = []
            self.step = -1  # a forked child counts its own steps (and --steps windows)
            self.lineage_steps = {}  # and its own steps of each kind, for both schedules
            self.fp_steps = {}
            self.in_step = self.tracing_step = False
            self.fps = self._new_fingerprints()
            self.native_pending = True
            self.device_times.reset()
            self.identity = {}
            self.stats = {k: 0 for k in self.stats}
            if self.dormant and self.enabled:  # (a stopped tracer's hook runs here too)
                self._wake_after_fork()
            for hook in self.after_fork_callbacks:
                hook()
        except Exception as exc:
            self.enabled = False
            sys.stderr.write(f"tensor-trace: could not re-open the trace after fork: {exc}\n")
