"""Merge and queries on damaged or mixed-up trace folders: one clear line, never a traceback."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tensor_trace.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)


def record(out, tp=2, env=None, steps=3):
    cmd = [os.path.join(VENV_BIN, "tensor-trace"), "record", "-o", str(out), "--",
           os.path.join(VENV_BIN, "torchrun"), "--standalone", "--nproc-per-node", str(tp),
           os.path.join(ROOT, "examples", "tp_llama.py"), "--layers", "2", "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="module")
def good(example_traces, tmp_path_factory):
    return example_traces.copy(2, tmp_path_factory.mktemp("good") / "t")


def copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("merged.sqlite*"))
    return str(dst)


def invoke(*args):
    r = CliRunner().invoke(main, list(map(str, args)))
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def test_missing_and_empty_folders(tmp_path):
    r = invoke("query", "placement", "--trace", tmp_path / "nope")
    assert r.exit_code == 2 and "no such trace folder" in r.output
    r = invoke("query", "placement", "--trace", tmp_path)
    assert r.exit_code == 2 and "no rank files" in r.output and len(r.output.strip().splitlines()) == 1


def test_not_a_trace_file_is_skipped_with_a_warning(good, tmp_path):
    d = copy(good, tmp_path / "t")
    with open(os.path.join(d, "ranks", "junk.ttr"), "w") as f:
        f.write("this is not a trace")
    r = invoke("query", "reduction", "model.embed_tokens", "--trace", d)
    assert r.exit_code == 0 and "post-reduction" in r.output
    assert "not a tensor-trace rank file" in r.output  # the warning (stderr is mixed in)
    only_junk = tmp_path / "junk"
    os.makedirs(only_junk / "ranks")
    shutil.copy(os.path.join(d, "ranks", "junk.ttr"), only_junk / "ranks")
    r = invoke("merge", only_junk)
    assert r.exit_code == 2 and "could be read" in r.output


def test_truncated_and_corrupt_files_give_partial_answers(good, tmp_path):
    d = copy(good, tmp_path / "t")
    files = sorted(os.listdir(os.path.join(d, "ranks")))
    p0, p1 = (os.path.join(d, "ranks", f) for f in files)
    data = open(p0, "rb").read()
    open(p0, "wb").write(data[: int(len(data) * 0.9)])
    data = bytearray(open(p1, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(64)
    open(p1, "wb").write(bytes(data))
    r = invoke("query", "placement", "model.layers.0.*", "--trace", d, "--json")
    assert r.exit_code == 0
    assert "truncated tail" in r.output and "corrupt chunk" in r.output
    rows = json.loads(r.stdout)
    assert any(p["point"] == "model.layers.0.self_attn.qkv_proj:output" for p in rows)


def test_rank_file_from_another_run_is_refused(good, example_traces, tmp_path):
    d = copy(good, tmp_path / "t")
    other = str(example_traces.original(3))
    shutil.copy(sorted(os.listdir(os.path.join(other, "ranks")))[0] and
                os.path.join(other, "ranks", sorted(os.listdir(os.path.join(other, "ranks")))[0]),
                os.path.join(d, "ranks", "zz-other.ttr"))
    r = invoke("merge", d)
    assert r.exit_code == 2 and "belongs to run" in r.output and "--replace" in r.output


def test_missing_rank_is_a_warning(good, tmp_path):
    d = copy(good, tmp_path / "t")
    os.remove(os.path.join(d, "ranks", sorted(os.listdir(os.path.join(d, "ranks")))[1]))
    r = invoke("query", "reduction", "model.embed_tokens", "--trace", d)
    assert r.exit_code == 0 and "rank(s) 1 of world size 2 left no rank file" in r.output


def test_random_corruption_never_crashes(good, tmp_path):
    from tensor_trace.errors import BadInput
    from tensor_trace.exporters.pipeline import merge_ranks

    rng = random.Random(7)
    src = [os.path.join(good, "ranks", f) for f in sorted(os.listdir(os.path.join(good, "ranks")))]
    originals = [open(p, "rb").read() for p in src]
    for trial in range(25):
        d = tmp_path / f"c{trial}"
        os.makedirs(d / "ranks")
        shutil.copy(os.path.join(good, "run.json"), d)
        for p, data in zip(src, originals):
            buf = bytearray(data)
            for _ in range(rng.randint(1, 40)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            if rng.random() < 0.3:
                buf = buf[: rng.randrange(len(buf))]
            open(d / "ranks" / os.path.basename(p), "wb").write(bytes(buf))
        try:
            merge_ranks(str(d), warn=lambda m: None)
        except BadInput:
            pass


def test_clock_offset_is_estimated_from_collectives(tmp_path):
    shift = 5_000_000_000
    # rank 1 runs with its clock 5 s ahead (a test shim, tests/integration/clock_shift)
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clock_shift")
    d = record(tmp_path / "t", env={"TEST_CLOCK_SHIFT_NS": f"1:{shift}", "PYTHONPATH": os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))})
    r = invoke("merge", d)
    assert r.exit_code == 0 and "offset" in r.output
    rows = json.loads(invoke("query", "sql", "SELECT rank, clock_offset_ns, clock_residual_ns, clock_matches "
                                             "FROM processes ORDER BY rank", "--trace", d, "--json").stdout)
    assert rows[0]["clock_offset_ns"] == 0
    assert abs(rows[1]["clock_offset_ns"] + shift) < 50_000_000, rows
    assert rows[1]["clock_matches"] >= 10 and rows[1]["clock_residual_ns"] < 50_000_000
    # After alignment both ranks' first all_reduce starts at about the same time.
    starts = json.loads(invoke("query", "sql", "SELECT rank, start_ns FROM collective_view WHERE seq = 0 "
                                               "ORDER BY rank", "--trace", d, "--json").stdout)
    assert abs(starts[0]["start_ns"] - starts[1]["start_ns"]) < 100_000_000
