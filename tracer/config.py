"""TraceConfig: what `tensor-trace record` asks every traced process to do.

It travels to child processes as environment variables (``tensor_trace.schema.ENV_*``), since
spawned and exec'd children share nothing else with the launcher.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import sys

from tensor_trace import schema


@dataclasses.dataclass
class TraceConfig:
    """Options of one recording (see ``tensor-trace record --help``)."""

    out_dir: str = "tensor-trace-out"
    run_id: str = ""
    modules: list[str] = dataclasses.field(default_factory=list)  # globs; empty = all
    exclude: list[str] = dataclasses.field(default_factory=list)
    steps: tuple[int, int | None] = (0, None)  # [first, stop) in steps of this process
    fingerprint: bool = True
    # "auto": deferred (batched at the end of the step) for small CUDA tensors, immediate on CPU;
    # "immediate" or "deferred" everywhere (see tracer/fingerprint.py for what each guarantees).
    fingerprint_mode: str = "auto"
    # Tensor lineage (tracer/lineage.py): ops that combine recorded tensors, during traced steps.
    lineage: bool = True
    # Wiring does not change from one step of a kind to the next, and watching every op costs
    # (bench/RESULTS.md): lineage is recorded in the first LINEAGE_FIRST traced steps of each
    # kind (root module, and a framework's forward mode / draft flag), then in every Nth of that
    # kind. 1 = every step. A watched step of the CPU example at tp=2 cost 7.8 M instructions
    # more than a fingerprinted one (0.65 of an untraced step): every 32nd was 2 points of
    # record's average step there, every 128th is 0.5.
    lineage_every: int = 128
    # Values change from step to step but the placement of a point does not, and fingerprinting
    # is most of what a traced step costs (bench/RESULTS.md): fingerprints are taken in the first
    # FINGERPRINT_FIRST traced steps of each kind (as lineage's kinds), then in every Nth of that
    # kind, and in every step that records lineage. Spans are recorded on every traced step.
    # 1 = every step; ``fingerprint=False`` turns them off entirely.
    fingerprint_every: int = 8
    # How module calls are intercepted. "call": ``torch.nn.Module.__call__`` is wrapped while
    # steps are traced (one Python frame per call, bench/RESULTS.md); "hooks": global forward
    # pre/post hooks (``always_call=True``), torch's own mechanism, whose slow path in
    # ``Module._call_impl`` alone costs more per call than everything the wrapper does.
    intercept: str = "call"
    otlp_endpoint: str | None = None
    # Live OTLP streams every collective span but module spans only of the first steps of each
    # kind and then of every Nth step of that kind (tracer/live_otlp.py, StreamPolicy): a decode
    # server makes more module spans than one process can send. 1 = every step.
    otlp_module_every: int = 16
    flush_interval_s: float = 1.0
    # After a step ends, the rank file is written once no record has come for this long (the
    # process went idle: a server after its last request, which may be SIGKILLed next).
    idle_flush_s: float = 0.05
    max_errors: int = 20  # after this many hook errors tracing turns itself off in the process
    max_spans_per_step: int = 1_000_000
    # Host knobs: environment variables read by each traced process itself, not options of
    # `record` (they travel as themselves, not in ENV_CONFIG). tracer/native.py's extension: "1"
    # on, "0" off, "auto" where CUDA is available or the machine can build it (native.enabled).
    native: str = dataclasses.field(default_factory=lambda: native_from_env())
    # tracer/multi_tensor.py's Triton kernel: "1" on, "0" off, "interpret" (tests, TRITON_INTERPRET).
    multi_tensor: str = dataclasses.field(default_factory=lambda: multi_tensor_from_env())
    # Device memory deferred fingerprints may hold before reducing mid-step (tracer/fingerprint.py).
    fp_hold_mib: int = dataclasses.field(default_factory=lambda: fp_hold_mib_from_env())

    def to_env(self) -> dict[str, str]:
        payload = dataclasses.asdict(self)
        for name in ("out_dir", "run_id", *HOST_KNOBS):
            payload.pop(name)
        return {
            schema.ENV_DIR: os.path.abspath(self.out_dir),
            schema.ENV_RUN_ID: self.run_id,
            schema.ENV_CONFIG: json.dumps(payload),
        }

    @classmethod
    def from_env(cls, environ=os.environ) -> "TraceConfig | None":
        out_dir = environ.get(schema.ENV_DIR)
        if not out_dir:
            return None
        payload = json.loads(environ.get(schema.ENV_CONFIG) or "{}")
        payload["steps"] = tuple(payload.get("steps") or (0, None))
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(out_dir=out_dir, run_id=environ.get(schema.ENV_RUN_ID, ""),
                   **{k: v for k, v in payload.items() if k in fields})

    def __post_init__(self) -> None:
        # The window as a range (not a field: to_env leaves it out): ``step in config.window``
        # is the one rule, read without a Python call where a step begins (tracer/steps.py)
        first, stop = self.steps
        self.window = range(first, sys.maxsize if stop is None else stop)

    def in_window(self, step: int) -> bool:
        return step in self.window

    def module_selector(self):
        """A predicate on module paths from --module/--exclude, or None when all are selected."""
        if not self.modules and not self.exclude:
            return None
        inc = [re.compile(fnmatch.translate(g)) for g in self.modules]
        exc = [re.compile(fnmatch.translate(g)) for g in self.exclude]

        def selected(path: str) -> bool:
            if inc and not any(p.match(path) for p in inc):
                return False
            return not any(p.match(path) for p in exc)

        return selected


HOST_KNOBS = ("native", "multi_tensor", "fp_hold_mib")  # TraceConfig fields read from the environment


def native_from_env(environ=os.environ) -> str:
    """``TENSOR_TRACE_NATIVE``: "1", "0" or "auto" (unset)."""
    return environ.get("TENSOR_TRACE_NATIVE", "auto") or "auto"


def multi_tensor_from_env(environ=os.environ) -> str:
    """``TENSOR_TRACE_MULTI_TENSOR``: "1" (unset), "0" or "interpret"."""
    return environ.get("TENSOR_TRACE_MULTI_TENSOR", "1")


def fp_hold_mib_from_env(environ=os.environ) -> int:
    """``TENSOR_TRACE_FP_HOLD_MIB``: at least 1; 512 when unset or unreadable."""
    try:
        return max(1, int(environ.get("TENSOR_TRACE_FP_HOLD_MIB", "512")))
    except ValueError:
        return 512


def parse_steps(text: str | None) -> tuple[int, int | None]:
    """Parse ``A:B`` (either side may be empty) into a half-open step window."""
    if not text:
        return (0, None)
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    if not m:
        raise ValueError(f"--steps expects A:B (for example 2:10), got {text!r}")
    first = int(m.group(1)) if m.group(1) else 0
    stop = int(m.group(2)) if m.group(2) else None
    if stop is not None and stop <= first:
        raise ValueError(f"--steps {text}: the window is empty (B must be greater than A)")
    return (first, stop)
