"""Helpers shared by the integration tests: every test runs real processes with timeouts.

``record(out_dir, cmd)`` runs ``tensor-trace record -o OUT_DIR -- CMD`` exactly as a user would
(the console script of the project's virtual environment), with ``OMP_NUM_THREADS=1`` so that
several ranks share two cores without oversubscription.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the virtual environment running pytest
PYTHON = str(BIN / "python")
TENSOR_TRACE = str(BIN / "tensor-trace")
TORCHRUN = str(BIN / "torchrun")
TP_LLAMA = str(ROOT / "examples" / "tp_llama.py")

# A small model: 2 layers (the EAGLE-3 aux layers must exist), a few steps.
LAYERS = 2
SMALL_MODEL = ["--layers", str(LAYERS), "--aux-layer-ids", "0,1"]

DEFAULT_TIMEOUT = 120


def base_env(**extra) -> dict:
    """The environment of every child: one OpenMP thread, unbuffered output, no tracing
    configuration inherited from the outside, the venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_TRACE_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "bootstrap" not in p]
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(pp)
    else:
        env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _descendants(pid: int) -> list:
    """Every live descendant of ``pid`` (Linux /proc), parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a timed-out ``record`` and everything it started: SIGTERM to record (it forwards it
    to the traced command's process group), then SIGKILL to each remaining descendant by pid
    (torchrun workers live in process groups of their own)."""
    if proc.poll() is not None:
        return
    tree = _descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_cmd(cmd, *, timeout=DEFAULT_TIMEOUT, cwd=ROOT, env=None, check=False) -> subprocess.CompletedProcess:
    """Run ``cmd`` (untraced or ``record``) to completion with a timeout; capture text output."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd), env=env or base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {cmd}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {cmd}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return res


def tt(*args) -> subprocess.CompletedProcess:
    """``tensor-trace ARGS``, its exit status left to the caller."""
    return run_cmd([TENSOR_TRACE, *args])


def lineage_json(trace, point) -> dict:
    """``tensor-trace query lineage POINT --json`` on the trace folder ``trace``, which must succeed."""
    r = tt("query", "lineage", point, "--trace", str(trace), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def placements(trace) -> dict:
    """``query placement '*:*' --json`` of a trace, by point name."""
    from click.testing import CliRunner

    from tensor_trace.cli import main

    r = CliRunner().invoke(main, ["query", "placement", "*:*", "--trace", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    return {p["point"]: p for p in json.loads(r.stdout)}


def record_cmd(out_dir, cmd, *options) -> list:
    return [TENSOR_TRACE, "record", "-o", str(out_dir), *options, "--", *[str(c) for c in cmd]]


def record(out_dir, cmd, *options, timeout=DEFAULT_TIMEOUT, check=True, **kw) -> subprocess.CompletedProcess:
    """``tensor-trace record -o OUT_DIR [OPTIONS] -- CMD``; fails the test on a non-zero exit
    unless ``check=False``."""
    return run_cmd(record_cmd(out_dir, cmd, *options), timeout=timeout, check=check, **kw)


def start_record(out_dir, cmd, *options, env=None, **popen_kw) -> subprocess.Popen:
    """Start ``record`` without waiting (for signal tests); stdout is a line-buffered pipe."""
    return subprocess.Popen(record_cmd(out_dir, cmd, *options), cwd=str(ROOT), env=env or base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                            start_new_session=True, **popen_kw)


def load_traces(out_dir) -> list:
    """Every rank file of a trace folder, resolved, sorted by rank (then pid)."""
    from tensor_trace.exporters.store.reader import load_rank_file, rank_files

    traces = [load_rank_file(p) for p in rank_files(str(out_dir))]
    return sorted(traces, key=lambda t: (t.rank is None, t.rank or 0, t.header.get("pid", 0)))


def write_script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


class LineReader:
    """Reads a pipe in a thread; keeps ``(time.time(), line)`` for every line as it arrives."""

    def __init__(self, stream):
        self.lines: list = []
        self._cond = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream):
        for line in iter(stream.readline, ""):
            with self._cond:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float):
        """The first line satisfying ``predicate`` (a line's text -> bool), or None on timeout/EOF."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, line in self.lines:
                    if predicate(line):
                        return line
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    return None
                self._cond.wait(left)

    def join(self, timeout: float = 10) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)


# The start of a script, shared by several tests: imports, a tiny model (10 spans per step:
# the root, 2 x (block, fc1, act, fc2), head) and make_model(). Tests append their main part.
TINY_MODEL = """
    import os, sys, time
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.act = torch.nn.GELU()
            self.fc2 = torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def make_model():
        torch.manual_seed(0)
        return Tiny().eval()
"""


KNOWN_EXIT_CRASH = "terminate called without an active exception"


def record_distributed(out_dir, cmd, *options, timeout=DEFAULT_TIMEOUT):
    """``record`` for a multi-rank run; fails the test on any non-zero exit. (A traced gloo run
    once aborted at exit in 20-40% of runs, because the tracer kept the model and the process
    group alive after destroy_process_group; test_lifetimes.py guards against that.)
    Returns (result, 0) for the callers written when this retried."""
    res = record(out_dir, cmd, *options, timeout=timeout, check=False)
    if res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {cmd}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}")
    return res, 0
