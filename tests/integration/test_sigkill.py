"""A traced process killed with SIGKILL keeps what was flushed (every second) before it died, and
a rank file cut anywhere reads as a prefix with the damage reported."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

from tt_helpers import (PYTHON, TINY_MODEL, LineReader, base_env, load_traces, start_record,
                        stop_tree, write_script)

FOREVER = TINY_MODEL + """
    print(f"pid {os.getpid()}", flush=True)
    m = make_model()
    step = 0
    with torch.no_grad():
        while True:
            m(torch.randn(4, 16))
            print(f"step {step} {time.time():.6f}", flush=True)
            step += 1
            time.sleep(0.2)
"""

SPANS_PER_STEP = 10  # root, 2 x (block, fc1, act, fc2), head
FLUSH_MARGIN_S = 1.2  # rank files are flushed every second


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigkill")
    script = write_script(tmp, "forever.py", FOREVER)
    proc = start_record(tmp / "trace", [PYTHON, script])
    out = LineReader(proc.stdout)
    try:
        line = out.wait_for(lambda s: s.startswith("pid "), 60)
        assert line, f"no pid line; stderr:\n{proc.stderr.read()}"
        child = int(line.split()[1])
        assert child != proc.pid
        assert out.wait_for(lambda s: s.startswith("step 0 "), 60), out.text()
        time.sleep(3)
        killed_at = time.time()
        os.kill(child, signal.SIGKILL)
        rc = proc.wait(30)
    finally:
        stop_tree(proc)
    out.join()
    stderr = proc.stderr.read()
    steps = {}
    for t, line in out.lines:
        if line.startswith("step "):
            _, n, when = line.split()
            steps[int(n)] = float(when)
    traces = load_traces(tmp / "trace")
    return dict(rc=rc, child=child, killed_at=killed_at, printed=steps, traces=traces, stderr=stderr)


def test_record_reports_the_kill(killed_run):
    assert killed_run["rc"] == 128 + signal.SIGKILL
    assert len(killed_run["traces"]) == 1
    assert killed_run["traces"][0].header["pid"] == killed_run["child"]
    assert "files:" in killed_run["stderr"]


def test_flushed_steps_survive_sigkill(killed_run):
    t = killed_run["traces"][0]
    printed = killed_run["printed"]
    assert len(printed) >= 8, printed  # ~3 s at ~0.2 s per step
    assert t.end is None  # SIGKILL: no end record
    old = [n for n, when in printed.items() if when < killed_run["killed_at"] - FLUSH_MARGIN_S]
    assert len(old) >= 3, (printed, killed_run["killed_at"])
    for n in old:
        assert n in t.steps, (n, sorted(t.steps))
        step = t.steps[n]
        assert step.t_end is not None
        assert len(step.spans) == SPANS_PER_STEP
        if step.fingerprinted:  # record's schedule: the first steps, then every 8th
            assert all(x.fp is not None for s in step.spans for x in s.tensors)
    assert sum(t.steps[n].fingerprinted for n in old) >= 3  # the first steps (of at least 3) all are
    # nothing from the future, and the steps recorded form a prefix
    assert sorted(t.steps) == list(range(len(t.steps)))
    assert len(t.steps) <= len(printed) + 1
    assert not t.report.corrupt_chunks


def _chunk_bounds(data: bytes):
    from tensor_trace import schema

    pos, bounds = len(schema.FILE_PREFIX), []
    while pos < len(data):
        _, length, _ = schema.CHUNK_HEAD.unpack_from(data, pos)
        bounds.append((pos, pos + schema.CHUNK_HEAD.size + length))
        pos += schema.CHUNK_HEAD.size + length
    return bounds


def _same_prefix(part, full):
    assert set(part.steps) <= set(full.steps)
    for n, step in part.steps.items():
        ref = full.steps[n]
        assert [s.path for s in step.spans] == [s.path for s in ref.spans][:len(step.spans)]
        assert [s.index for s in step.spans] == [s.index for s in ref.spans][:len(step.spans)]


def test_truncated_copy_reads_as_prefix(killed_run, tmp_path):
    from tensor_trace.exporters.store.reader import load_rank_file

    full = killed_run["traces"][0]
    data = open(full.path, "rb").read()
    bounds = _chunk_bounds(data)
    assert len(bounds) >= 3, bounds
    rng = random.Random(1234)
    cuts = [rng.randrange(len(data) // 4, 3 * len(data) // 4) for _ in range(6)]
    # and cuts inside a chunk's payload, inside a chunk's header, right on a boundary
    start, end = bounds[len(bounds) // 2]
    cuts += [(start + end) // 2, start + 5, start]
    for i, cut in enumerate(cuts):
        path = tmp_path / f"cut{i}.ttr"
        path.write_bytes(data[:cut])
        part = load_rank_file(str(path))  # must not raise
        assert part.header == full.header
        _same_prefix(part, full)
        on_boundary = any(cut == e for _, e in bounds)
        if on_boundary:
            assert not part.report.problems()
        else:
            assert part.report.truncated_tail or part.report.corrupt_chunks, (cut, part.report)
            assert part.report.skipped_bytes > 0
        assert len(part.steps) <= len(full.steps)
    # the middle chunk cut in half loses that chunk only
    part = load_rank_file(str(tmp_path / "cut6.ttr"))
    assert part.report.truncated_tail and part.report.chunks == len(bounds) // 2


def test_corrupt_middle_chunk_is_skipped(killed_run, tmp_path):
    """A flipped byte in a middle chunk: that chunk is reported corrupt, the rest still reads."""
    from tensor_trace.exporters.store.reader import load_rank_file

    full = killed_run["traces"][0]
    data = bytearray(open(full.path, "rb").read())
    bounds = _chunk_bounds(bytes(data))
    start, end = bounds[len(bounds) // 2]
    data[(start + end) // 2] ^= 0xFF
    path = tmp_path / "flipped.ttr"
    path.write_bytes(bytes(data))
    part = load_rank_file(str(path))
    assert part.report.corrupt_chunks == 1 and not part.report.truncated_tail
    assert part.report.chunks == len(bounds) - 1
    assert max(part.steps) == max(full.steps)


# Ctrl-C followed by a SIGKILL the traced process cannot see coming: a server's launcher
# killing its workers, or a worker's PR_SET_PDEATHSIG when its parent exits first (SGLang's
# schedulers under DP attention). The periodic flush is an hour away and the steps keep
# coming (no idle flush), so only the SIGINT itself can have written them; the program's own
# SIGINT handler does nothing, as a main thread busy in native code would not either.
CTRL_C_THEN_KILLED = TINY_MODEL + """
    import json, signal
    from tensor_trace import schema
    os.environ[schema.ENV_DIR] = sys.argv[1]
    os.environ[schema.ENV_CONFIG] = json.dumps(dict(flush_interval_s=3600))
    from tensor_trace.tracer import env_start
    env_start.start_from_env()
    signal.signal(signal.SIGINT, lambda signum, frame: print("sigint", flush=True))
    print(f"pid {os.getpid()}", flush=True)
    m = make_model()
    step = 0
    with torch.no_grad():
        while True:
            m(torch.randn(4, 16))
            print(f"step {step}", flush=True)
            step += 1
            time.sleep(0.01)
"""


def test_steps_before_ctrl_c_survive_a_sigkill_that_follows(tmp_path):
    from tensor_trace.exporters.store.reader import load_rank_file, rank_files

    script = write_script(tmp_path, "ctrl_c.py", CTRL_C_THEN_KILLED)
    out = tmp_path / "trace"
    proc = subprocess.Popen([PYTHON, str(script), str(out)], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
    lines = LineReader(proc.stdout)
    try:
        assert lines.wait_for(lambda s: s == "step 20", 60), (lines.text(), proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        assert lines.wait_for(lambda s: s == "sigint", 30), lines.text()
        # every step printed before the handler ran, on disk within seconds (polled: no sleep)
        text = [line for _, line in lines.lines]
        printed = [int(line.split()[1]) for line in text[:text.index("sigint")] if line.startswith("step ")]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            files = rank_files(str(out))
            if files and max(load_rank_file(files[0]).steps, default=-1) >= max(printed):
                break
            time.sleep(0.1)
        proc.kill()
        proc.wait(30)
    finally:
        stop_tree(proc)
    (t,) = load_traces(out)
    assert t.end is None  # SIGKILLed: nothing completed the file
    missing = [n for n in printed if n not in t.steps or t.steps[n].t_end is None]
    assert not missing, (missing, sorted(t.steps))
    assert all(len(t.steps[n].spans) == SPANS_PER_STEP for n in printed)
