"""Run a command under tracing: the launcher side of ``tensor-trace record``.

The command is started in its own process group with the bootstrap folder first on PYTHONPATH
and the configuration in the environment. SIGINT and SIGTERM received by the launcher are
forwarded to that whole group (as a terminal would deliver Ctrl-C to a foreground job), and the
launcher keeps waiting so the children can complete their rank files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from tensor_trace import schema
from tensor_trace.errors import BadInput
from tensor_trace.tracer.config import TraceConfig

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def prepare_out_dir(out_dir: str, replace: bool, how: str = "use --replace to overwrite it or -o to choose "
                    "another folder", run_id: str | None = None) -> None:
    """Refuse to mix two runs in one folder unless ``replace``; ``how`` says how to get past it.

    A folder whose run.json names ``run_id`` is joined: the nodes of one multi-node run
    (``record --run-id``) may write their rank files into one shared folder."""
    ranks = os.path.join(out_dir, "ranks")
    existing = os.path.isdir(ranks) and any(f.endswith(schema.RANK_FILE_SUFFIX) for f in os.listdir(ranks))
    if existing or os.path.exists(os.path.join(out_dir, "run.json")):
        if run_id is not None and not replace and schema.read_run_id(out_dir) == run_id:
            os.makedirs(ranks, exist_ok=True)
            return
        if not replace:
            raise BadInput(f"{out_dir} already holds a recorded run; {how}")
        shutil.rmtree(ranks, ignore_errors=True)
        for name in os.listdir(out_dir):
            if name == "run.json" or name.startswith("merged."):
                os.remove(os.path.join(out_dir, name))
    os.makedirs(ranks, exist_ok=True)


def child_env(config: TraceConfig, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(config.to_env())
    env[schema.ENV_BOOTSTRAP] = BOOTSTRAP_DIR
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + old if old else "")
    return env


def _write_run_file(run_file: str, run: dict) -> None:
    # Written whole then renamed: another node's record joining the folder reads it meanwhile.
    tmp = f"{run_file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(run, f, indent=1)
    os.replace(tmp, run_file)


def run_traced(cmd: list[str], config: TraceConfig) -> int:
    """Run ``cmd`` traced; return its exit code (128 + N when it died of signal N)."""
    run_file = os.path.join(config.out_dir, "run.json")
    run = dict(run_id=config.run_id, argv=cmd, started_wall_ns=time.time_ns(), config=json.loads(
        config.to_env()[schema.ENV_CONFIG]))
    try:
        proc = subprocess.Popen(cmd, env=child_env(config), process_group=0)
    except FileNotFoundError:
        raise BadInput(f"command not found: {cmd[0]}")
    except PermissionError:
        raise BadInput(f"command not executable: {cmd[0]}")
    _write_run_file(run_file, run)  # only once something runs: a failed start leaves no run
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    run.update(exit_code=code, ended_wall_ns=time.time_ns(), signals_forwarded=received)
    _write_run_file(run_file, run)
    return 128 - code if code < 0 else code
