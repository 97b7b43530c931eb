"""Progress lines: drawn on stderr when it is a terminal (a pseudo-terminal here), absent with
--quiet and when stderr is a pipe; stdout is the same in every case."""

import os
import pty
import subprocess

import pytest
import torch

import tensor_trace
from tt_helpers import TENSOR_TRACE, base_env


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "t"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with tensor_trace.trace(out_dir=str(out)):
        for _ in range(3):
            model(torch.randn(2, 4))
    return str(out)


def run_with_tty_stderr(*args) -> tuple:
    """(stdout, what the command wrote to its terminal stderr, exit code)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([TENSOR_TRACE, *args], stdout=subprocess.PIPE, stderr=slave, env=base_env())
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal closed: the command has exited
            break
        if not chunk:
            break
        err += chunk
    out = p.stdout.read()
    p.wait(120)
    os.close(master)
    return out.decode(), err.decode(), p.returncode


@pytest.mark.parametrize("command", [["merge"], ["export", "perfetto", "--trace"], ["report", "--trace"]])
def test_progress_on_a_terminal_only(trace_dir, command):
    args = [*command, trace_dir]
    out, err, code = run_with_tty_stderr(*args)
    assert code == 0, err
    label = {"merge": "merge: rank files", "export": "export perfetto", "report": "report: placement map"}[command[0]]
    assert label in err and "\r" in err
    quiet_out, quiet_err, code = run_with_tty_stderr(*args, "--quiet")
    assert code == 0 and quiet_err == ""
    piped = subprocess.run([TENSOR_TRACE, *args], capture_output=True, text=True, env=base_env(), timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""
    assert out == quiet_out == piped.stdout
