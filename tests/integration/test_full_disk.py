"""A disk that fills up under a traced program: the program runs on and exits normally; the
records that could not be written are lost, counted in END's stats and in `record`'s summary,
and the rank file holds no torn chunk (what was written before and after reads back)."""

from __future__ import annotations

from tt_helpers import PYTHON, TINY_MODEL, load_traces, record, write_script

FILL_THEN_FREE = TINY_MODEL + """
    import resource, signal
    from tensor_trace import tracer

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    m = make_model()

    def steps(n):
        with torch.no_grad():
            for _ in range(n):
                m(torch.randn(4, 16))
        tracer.current().writer.flush()

    steps(2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # The disk is full: a few bytes of room, then nothing (a short write, then EFBIG).
    size = tracer.current().writer.bytes_written
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
    steps(3)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
    steps(2)
    print("program done", flush=True)
"""


def test_a_full_disk_loses_records_not_the_program(tmp_path):
    out = tmp_path / "trace"
    res = record(out, [PYTHON, write_script(tmp_path, "fill.py", FILL_THEN_FREE)], timeout=120)
    assert res.returncode == 0 and "program done" in res.stdout
    assert "tensor-trace: cannot write " in res.stderr  # the traced process says so, once
    assert res.stderr.count("tensor-trace: cannot write ") == 1
    (t,) = load_traces(out)
    assert not t.report.problems(), t.report.problems()  # no torn chunk, no dangling id
    lost = t.end["stats"]["write_errors"]
    assert lost >= 1
    # the steps written before the disk filled and after it had room again are whole
    assert {0, 1, 5, 6} <= set(t.steps)
    assert not {2, 3, 4} & set(t.steps)
    assert f"warning: {lost} write(s) of the trace failed (disk full?)" in res.stderr
