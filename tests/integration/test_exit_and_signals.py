"""`tensor-trace record` exits with the command's code, forwards SIGINT/SIGTERM to it, prints a
summary, and refuses to mix two runs in one folder."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tt_helpers import (PYTHON, TINY_MODEL, LineReader, base_env, load_traces, record,
                        start_record, stop_tree, write_script)

SPANS_PER_STEP = 10

RUN_THEN = TINY_MODEL + """
    import signal
    m = make_model()
    with torch.no_grad():
        for step in range(3):
            m(torch.randn(4, 16))
    print("ran 3 steps", flush=True)
    how = sys.argv[1]
    if how == "exit3":
        sys.exit(3)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("still alive after SIGTERM", flush=True)
    if how == "marker":
        open(sys.argv[2], "w").write("ran")
"""


def _script(tmp_path):
    return write_script(tmp_path, "run_then.py", RUN_THEN)


def _complete_steps(t, n):
    assert sorted(t.steps) == list(range(n))
    for step in t.steps.values():
        assert step.t_end is not None and len(step.spans) == SPANS_PER_STEP


def test_exit_code_of_python_sys_exit(tmp_path):
    res = record(tmp_path / "trace", [PYTHON, _script(tmp_path), "exit3"], check=False, timeout=60)
    assert res.returncode == 3, res.stderr
    assert "ran 3 steps" in res.stdout
    (t,) = load_traces(tmp_path / "trace")
    _complete_steps(t, 3)
    assert t.end is not None and t.end["reason"] == "exit"


def test_exit_code_of_non_python_command(tmp_path):
    res = record(tmp_path / "trace", ["false"], check=False, timeout=30)
    assert res.returncode == 1
    assert load_traces(tmp_path / "trace") == []
    assert "0 traced process(es)" in res.stderr


def test_command_killed_by_sigterm_exits_143(tmp_path):
    """The traced process sends itself SIGTERM: the tracer's handler completes the rank file, then
    the process dies of SIGTERM as it would have, and record exits 128 + 15."""
    res = record(tmp_path / "trace", [PYTHON, _script(tmp_path), "sigterm"], check=False, timeout=60)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert "still alive" not in res.stdout
    (t,) = load_traces(tmp_path / "trace")
    _complete_steps(t, 3)
    assert t.end is not None and t.end["reason"] == "SIGTERM"


def test_command_not_found(tmp_path):
    res = record(tmp_path / "trace", ["/nonexistent/command"], check=False, timeout=30)
    assert res.returncode == 2
    assert res.stderr.strip() == "tensor-trace: command not found: /nonexistent/command"


def test_summary_names_ranks_spans_and_folder(tmp_path):
    out = tmp_path / "trace"
    res = record(out, [PYTHON, _script(tmp_path), "none"], timeout=60)
    lines = res.stderr.strip().splitlines()
    # The summary is the last thing on stderr (the traced program may warn before it).
    first = next(i for i, line in enumerate(lines) if line.startswith("tensor-trace: "))
    lines = lines[first:]
    assert lines[0].startswith("tensor-trace: 0 rank(s) in 1 traced process(es), 3 step(s), "
                               f"{3 * SPANS_PER_STEP} module spans, 0 collectives"), lines
    assert "0 tracer error(s)" in lines[0]
    assert lines[-1] == f"  files: {out}"
    (t,) = load_traces(out)
    assert any(line.split()[:4] == ["rank", "?", "pid", str(t.header["pid"])] for line in lines), lines


def test_existing_run_folder_is_refused_unless_replace(tmp_path):
    out = tmp_path / "trace"
    script = _script(tmp_path)
    record(out, [PYTHON, script, "none"], timeout=60)
    (first,) = load_traces(out)

    marker = tmp_path / "second-ran"
    res = record(out, [PYTHON, script, "marker", marker], check=False, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds a recorded run" in lines[0] and "--replace" in lines[0], lines
    assert not marker.exists(), "the command must not run"
    assert [t.path for t in load_traces(out)] == [first.path]

    res = record(out, [PYTHON, script, "marker", marker], "--replace", timeout=60)
    assert marker.exists()
    (second,) = load_traces(out)
    assert second.header["pid"] != first.header["pid"] and not os.path.exists(first.path)
    assert second.header["run_id"] != first.header["run_id"]


def test_bad_steps_window_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "trace"
    res = record(out, ["true"], "--steps", "3:1", check=False, timeout=30)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensor-trace: --steps 3:1"), lines
    assert not out.exists()


def test_command_not_found_leaves_the_folder_reusable(tmp_path):
    out = tmp_path / "trace"
    res = record(out, ["/nonexistent/command"], check=False, timeout=30)
    assert res.returncode == 2
    res = record(out, ["true"], check=False, timeout=30)
    assert res.returncode == 0, res.stderr


def test_end_record_counts_the_bytes_written(tmp_path):
    """END's byte count covers everything before it (a run shorter than the 1 s flush interval
    has all its records in the final flush; they must be counted too)."""
    from tensor_trace import schema

    out = tmp_path / "trace"
    record(out, [PYTHON, _script(tmp_path), "none"], timeout=60)
    (t,) = load_traces(out)
    data = open(t.path, "rb").read()
    pos, last = len(schema.FILE_PREFIX), 0
    while pos < len(data):
        _, length, _ = schema.CHUNK_HEAD.unpack_from(data, pos)
        last = schema.CHUNK_HEAD.size + length
        pos += last
    assert pos == len(data)
    # END comes in a chunk of its own, after everything else was flushed and counted
    assert last < 512, last
    assert t.end["stats"]["bytes"] == len(data) - last, (t.end["stats"]["bytes"], len(data), last)


LOOP = TINY_MODEL + """
    import signal
    mode, marker = sys.argv[1], sys.argv[2]

    if mode == "sigint":
        def on_sigint(signum, frame):
            open(marker, "w").write("SIGINT")
            sys.exit(0)
        signal.signal(signal.SIGINT, on_sigint)

    m = make_model()
    step = 0
    with torch.no_grad():
        while True:
            m(torch.randn(4, 16))
            print(f"step {step}", flush=True)
            step += 1
            time.sleep(float(os.environ["LOOP_SLEEP"]))
"""


def _signal_record(tmp_path, mode, sig, pause):
    script = write_script(tmp_path, "loop.py", LOOP)
    marker = tmp_path / "marker"
    proc = start_record(tmp_path / "trace", [PYTHON, script, mode, marker],
                        env=base_env(LOOP_SLEEP=pause))
    out = LineReader(proc.stdout)
    try:
        assert out.wait_for(lambda s: s == "step 3", 60), (out.text(), proc.stderr.read())
        proc.send_signal(sig)  # to record, not to the traced process
        rc = proc.wait(30)
    finally:
        stop_tree(proc)
    out.join()
    stderr = proc.stderr.read()
    printed = [int(line.split()[1]) for _, line in out.lines if line.startswith("step ")]
    return rc, marker, printed, stderr, load_traces(tmp_path / "trace")


def _check_file_complete(traces, printed):
    (t,) = traces
    assert t.end is not None, "no END record: the rank file was not completed"
    assert not t.report.problems()
    assert len(printed) >= 4
    # every step the program finished is in the file, complete; the step that was interrupted
    # (if any) is closed too
    for n in printed:
        assert t.steps[n].t_end is not None and len(t.steps[n].spans) == SPANS_PER_STEP
    assert sorted(t.steps) == list(range(len(t.steps))) and len(t.steps) <= len(printed) + 1
    assert all(s.t_end is not None for s in t.steps.values())
    return t


# "between": the signal lands while the program sleeps between steps; "mid-step": the loop
# never sleeps, so it lands inside a forward pass (and often inside a tracer hook).
PAUSES = pytest.mark.parametrize("pause", ["0.05", "0"], ids=["between", "mid-step"])


@PAUSES
def test_sigint_is_forwarded_to_the_command(tmp_path, pause):
    rc, marker, printed, stderr, traces = _signal_record(tmp_path, "sigint", signal.SIGINT, pause)
    assert marker.exists() and marker.read_text() == "SIGINT"
    assert rc == 0, stderr
    t = _check_file_complete(traces, printed)
    assert t.end["reason"] == "exit"
    assert "KeyboardInterrupt" not in stderr
    assert "files:" in stderr  # record itself was not interrupted: it printed its summary


@PAUSES
def test_sigterm_is_forwarded_to_the_command(tmp_path, pause):
    rc, marker, printed, stderr, traces = _signal_record(tmp_path, "plain", signal.SIGTERM, pause)
    assert rc == 128 + signal.SIGTERM, stderr
    t = _check_file_complete(traces, printed)
    assert t.end["reason"] == "SIGTERM"
    assert "files:" in stderr


BLOCKED = """
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist

    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        m(torch.ones(1, 4))  # one traced step: the tracer is running
    # Block in native code, as a rank does in a hung collective or rendezvous.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(f"blocking {os.getpid()}", flush=True)
    try:
        store.wait(["never"], datetime.timedelta(seconds=WAIT_S))
    except Exception:
        pass
    print("wait ended", flush=True)
"""
WAIT_S = 8
PROMPT_S = 3  # SIG_DFL kills in milliseconds; allow for a slow machine


def _blocked_script(tmp_path):
    return write_script(tmp_path, "blocked.py", BLOCKED.replace("WAIT_S", str(WAIT_S)))


def _time_to_die(proc, out):
    assert out.wait_for(lambda s: s.startswith("blocking "), 60), out.text()
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(WAIT_S + 30)
    finally:
        stop_tree(proc)
    return rc, time.monotonic() - t0


def test_untraced_process_blocked_in_native_code_dies_on_sigterm(tmp_path):
    # the premise of the next test
    proc = subprocess.Popen([PYTHON, _blocked_script(tmp_path)], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    out = LineReader(proc.stdout)
    rc, took = _time_to_die(proc, out)
    assert rc == -signal.SIGTERM and took < PROMPT_S, (rc, took)


def test_traced_process_blocked_in_native_code_dies_on_sigterm(tmp_path):
    proc = start_record(tmp_path / "trace", [PYTHON, _blocked_script(tmp_path)])
    out = LineReader(proc.stdout)
    rc, took = _time_to_die(proc, out)  # SIGTERM to record, forwarded to the process group
    out.join()
    assert rc == 128 + signal.SIGTERM, rc
    assert "wait ended" not in out.text()
    assert took < PROMPT_S, f"record and the traced process took {took:.1f}s to die of SIGTERM"
