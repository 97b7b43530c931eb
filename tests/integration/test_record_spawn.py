"""Processes that the traced command starts itself: torch.multiprocessing spawn ranks,
multiprocessing fork / forkserver children, a subprocess Python child and a non-Python child."""

from __future__ import annotations

import re

import pytest

from tt_helpers import (LAYERS, PYTHON, SMALL_MODEL, TINY_MODEL, TP_LLAMA, load_traces, record,
                        record_distributed, write_script)

STEPS = 3


def test_spawn_two_ranks(tmp_path):
    res, _ = record_distributed(tmp_path / "trace", [PYTHON, TP_LLAMA, "--spawn", "2", *SMALL_MODEL,
                                                     "--steps", str(STEPS)])
    assert len(re.findall(r"^step \d+ logits_sum=", res.stdout, re.M)) == STEPS  # rank 0 prints
    traces = load_traces(tmp_path / "trace")
    # two spawned ranks; the launching process imports torch but runs no model: no file
    assert [t.rank for t in traces] == [0, 1], [(t.path, t.identity) for t in traces]
    assert len({t.header["pid"] for t in traces}) == 2
    for t in traces:
        assert t.identity["world_size"] == 2 and t.identity.get("backend") == "gloo"
        assert t.end is not None and t.end["reason"] == "exit"
        assert sorted(t.steps) == list(range(STEPS))
        for step in t.steps.values():
            ops = [c.op for c in step.collectives]
            assert ops.count("all_reduce") == 1 + 2 * LAYERS and ops.count("all_gather") == 1, ops
            assert len(ops) == 2 + 2 * LAYERS
            assert {s.path for s in step.spans} >= {"", "model.embed_tokens", "lm_head", "draft.fc",
                                                    "model.layers.1.mlp.down_proj"}
    seqs = [[(c.op, c.seq) for s in sorted(t.steps) for c in t.steps[s].collectives] for t in traces]
    assert seqs[0] == seqs[1]


CHILDREN = TINY_MODEL + """
    import multiprocessing as mp
    import subprocess

    CHILD_STEPS = 4

    def work(tag):
        m = make_model()
        with torch.no_grad():
            for _ in range(CHILD_STEPS):
                m(torch.randn(3, 16))
        print(f"child {tag} {os.getpid()}", flush=True)

    if __name__ == "__main__":
        if sys.argv[1:] == ["--child"]:
            work("subprocess")
            sys.exit(0)
        print(f"parent {os.getpid()}", flush=True)
        for method in ("fork", "forkserver"):
            p = mp.get_context(method).Process(target=work, args=(method,))
            p.start()
            p.join()
            assert p.exitcode == 0, (method, p.exitcode)
        subprocess.run([sys.executable, __file__, "--child"], check=True)
        subprocess.run(["true"], check=True)
        subprocess.run(["/bin/echo", "echo child"], check=True)
        print("parent done", flush=True)
"""


@pytest.fixture(scope="module")
def children_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("children")
    script = write_script(tmp, "children.py", CHILDREN)
    res = record(tmp / "trace", [PYTHON, script], timeout=90)
    pids = dict(re.findall(r"^child (\S+) (\d+)$", res.stdout, re.M))
    return res, {k: int(v) for k, v in pids.items()}, load_traces(tmp / "trace")


def test_children_ran_and_non_python_child_is_harmless(children_run):
    res, pids, traces = children_run
    assert res.returncode == 0
    assert sorted(pids) == ["fork", "forkserver", "subprocess"], res.stdout
    assert "echo child" in res.stdout and "parent done" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr
    for needle in ("tensor-trace: error", "tracing not started", "could not re-open"):
        assert needle not in res.stderr, res.stderr
    assert "0 tracer error(s)" in res.stderr
    # the parent runs no model: it has no rank file
    parent = int(re.search(r"^parent (\d+)$", res.stdout, re.M).group(1))
    assert parent not in {t.header["pid"] for t in traces}


def _child_trace(children_run, tag):
    res, pids, traces = children_run
    mine = [t for t in traces if t.header["pid"] == pids[tag]]
    assert len(mine) == 1, (tag, pids, [(t.path, t.header["pid"]) for t in traces])
    return mine[0]


def _check_child(t):
    assert sorted(t.steps) == [0, 1, 2, 3]
    for step in t.steps.values():
        assert step.t_end is not None
        assert [s.path for s in step.spans].count("") == 1
        assert {s.path for s in step.spans} == {"", "blocks.0", "blocks.0.fc1", "blocks.0.act",
                                                "blocks.0.fc2", "blocks.1", "blocks.1.fc1",
                                                "blocks.1.act", "blocks.1.fc2", "head"}
    assert t.end is not None and t.end["reason"] == "exit"
    assert not t.report.problems() and not t.errors


def test_one_rank_file_per_process(children_run):
    res, pids, traces = children_run
    assert len(traces) == 3, [(t.path, t.header["pid"], len(t.steps)) for t in traces]
    assert sorted(t.header["pid"] for t in traces) == sorted(pids.values())


def test_subprocess_child_is_traced(children_run):
    _check_child(_child_trace(children_run, "subprocess"))


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_multiprocessing_child_is_traced(children_run, method):
    _check_child(_child_trace(children_run, method))
