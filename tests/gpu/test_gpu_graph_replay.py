"""CUDA-graph replays traced on a real GPU: the example captured in a graph and replayed with new
inputs gives the fingerprints, outputs and verdicts of eager steps, at TP=1 and (two GPUs, NCCL
inside the graph) TP=2. Skipped without CUDA; run on the lent H200 by bench/gpu_run.sh."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tensor_trace.exporters import query
from tensor_trace.exporters.analysis import tolerance
from tensor_trace.exporters.pipeline import open_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (CUDA-graph capture and replay); the CPU "
                                       "bookkeeping is tests/unit/test_cuda_graph_replay.py")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tp_llama.py")


def _run(args, timeout=300):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def points_of_step(con, step) -> dict:
    return {p["point"]: p for p in query.placement(con, "*:*", step=step)}


def replays_against_eager(eager_dir, graph_dir) -> dict:
    """Every replayed step of the graph run against the eager step of the same input (example
    step k is graph-run step k + 1: step 0 is the eager warm-up, step 1 the capture): the points
    that differ, the fingerprints outside the tolerance of exporters/analysis/tolerance.py, and
    the placement/reduction verdicts that differ."""
    ce, cg = open_store(str(eager_dir)), open_store(str(graph_dir))
    steps = [(s, json.loads(a or "{}"), f) for s, a, f in cg.execute(
        "SELECT step, attrs, MIN(fingerprinted) FROM steps GROUP BY step ORDER BY step")]
    replays = [s for s, a, _ in steps if a.get("replay_of") is not None]
    fingerprinted = [s for s, a, f in steps if a.get("replay_of") is not None and f]
    out = dict(replayed_steps=len(replays), fingerprinted=fingerprinted, points=0,
               point_sets_differ=[], fingerprints_off=[], verdicts_off=[])
    for gstep in fingerprinted:  # (a replay the schedule skipped has no values to compare)
        e, g = points_of_step(ce, gstep - 1), points_of_step(cg, gstep)
        if e.keys() != g.keys():
            out["point_sets_differ"].append((gstep, sorted(e.keys() ^ g.keys())[:5]))
        for name in sorted(e.keys() & g.keys()):
            x, y = e[name], g[name]
            out["points"] += 1
            if (x["placement"], x["reduction"]) != (y["placement"], y["reduction"]):
                out["verdicts_off"].append((gstep, name, x["placement"], x["reduction"], y["placement"], y["reduction"]))
            fx, fy = x.get("fingerprint"), y.get("fingerprint")
            shape, dtype = next(iter(x["shapes"].values())), x.get("dtype") or "bfloat16"
            if fx is None or fy is None or not tolerance.fp_equal(tolerance.Observed(shape, dtype, tuple(fx)),
                                                                  tolerance.Observed(shape, dtype, tuple(fy))):
                out["fingerprints_off"].append((gstep, name, fx, fy))
    return out


def launcher(tp):
    return [] if tp == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(tp)]


@pytest.mark.parametrize("dtype,tp", [("float32", 1), ("bfloat16", 1),
                                      pytest.param("bfloat16", 2, marks=pytest.mark.skipif(
                                          torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs"))])
def test_replays_match_eager_steps_of_the_same_inputs(tmp_path, dtype, tp):
    common = ["--device", "cuda", "--dtype", dtype, "--steps", "5", "--batch", "4", "--seq", "8"]
    run = [*launcher(tp), EXAMPLE, *common]
    plain, traced = tmp_path / "plain.json", tmp_path / "traced.json"
    _run([*run, "--cuda-graph", "--out", str(plain)])
    # every step fingerprinted, eager and replayed: each replay is compared with an eager step
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "graph"), "--fingerprint-every", "1", "--",
          sys.executable, *run, "--cuda-graph", "--out", str(traced)])
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "eager"), "--fingerprint-every", "1", "--",
          sys.executable, *run, "--out", str(tmp_path / "eager.json")])
    got = replays_against_eager(tmp_path / "eager", tmp_path / "graph")
    print(f"TP={tp} {dtype}: {got['replayed_steps']} replays, {got['points']} points against eager")
    assert got["replayed_steps"] == 4 and got["points"] > 0, got
    assert not got["point_sets_differ"], got["point_sets_differ"]
    assert not got["fingerprints_off"], got["fingerprints_off"][:6]
    assert not got["verdicts_off"], got["verdicts_off"][:6]
    # the graph's outputs are bitwise the same with tracing on as without (every step, replays too)
    plain_steps, traced_steps = (json.loads(p.read_text())["steps"] for p in (plain, traced))
    assert len(plain_steps) == len(traced_steps) == 5
    assert [(p["logits_sha256"], p["draft_sha256"]) for p in plain_steps] == \
        [(t["logits_sha256"], t["draft_sha256"]) for t in traced_steps]


def test_replays_on_a_schedule_gate_the_kernels_and_match_eager(tmp_path):
    """Under a fingerprint schedule the graph's kernels are gated off on the replays it skips and
    on again on the ones it picks: those still match the eager steps of the same inputs (a gate
    left off would give zero sums; one left on, values nobody asked for, which is only cost)."""
    common = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "12", "--batch", "4", "--seq", "8"]
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "graph"), "--fingerprint-every", "3", "--",
          sys.executable, EXAMPLE, *common, "--cuda-graph"])
    _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / "eager"), "--fingerprint-every", "1", "--",
          sys.executable, EXAMPLE, *common])
    got = replays_against_eager(tmp_path / "eager", tmp_path / "graph")
    print(f"schedule every 3: {got['replayed_steps']} replays, fingerprinted {got['fingerprinted']}, "
          f"{got['points']} points against eager")
    assert got["replayed_steps"] == 11
    # graph-run steps 2..12 are replays 0..10: the first 4, then every 3rd
    assert got["fingerprinted"] == [2 + n for n in range(11) if n < 4 or n % 3 == 0]
    assert got["points"] > 0 and not got["point_sets_differ"], got["point_sets_differ"]
    assert not got["fingerprints_off"], got["fingerprints_off"][:6]
    assert not got["verdicts_off"], got["verdicts_off"][:6]


def test_compare_eager_with_replays_and_name_a_stale_input_buffer(tmp_path):
    """`tensor-trace compare` of eager steps against CUDA-graph replays of the same inputs finds
    no divergence; with the planted bug (replays never refresh the static input buffer) it names
    the first point that parts. Example step k is graph-run step k + 1 (step 1 is the capture)."""
    common = ["--device", "cuda", "--dtype", "float32", "--steps", "5", "--batch", "4", "--seq", "8"]
    runs = {"eager": [], "graph": ["--cuda-graph"], "stale": ["--cuda-graph", "--bug-stale-graph-input"]}
    for name, extra in runs.items():
        _run(["-m", "tensor_trace", "record", "-o", str(tmp_path / name), "--fingerprint-every", "1", "--",
              sys.executable, EXAMPLE, *common, *extra])

    def compare(b):
        r = subprocess.run([sys.executable, "-m", "tensor_trace", "compare", str(tmp_path / "eager"),
                            str(tmp_path / b), "--steps", "1-4:2", "--json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode in (0, 1), r.stderr[-3000:]
        out = json.loads(r.stdout)
        statuses = [p["status"] for p in out["points"]]
        worst = max((p for p in out["points"] if p.get("rel_error") is not None),
                    key=lambda p: p["rel_error"], default=None)
        print(f"compare eager {b}: exit {r.returncode}, {len(statuses)} points "
              f"{ {s: statuses.count(s) for s in set(statuses)} }, first divergence "
              f"{out['first_divergence'] and {k: out['first_divergence'][k] for k in ('point', 'rel_error', 'tolerance')}}"
              f", largest relative error {worst and (worst['point'], worst['rel_error'], worst.get('tolerance'))}")
        return r.returncode, out

    code, same = compare("graph")
    assert code == 0 and same["first_divergence"] is None, same["first_divergence"]
    assert same["points"] and all(p["status"] == "same" for p in same["points"])
    code, stale = compare("stale")
    first = stale["first_divergence"]
    assert code == 1 and first is not None
    # The replays read the captured step's ids: the first point in execution order that parts
    # is the step's input itself (the root module's ``:input.0``), the ids of the wrong step.
    assert first["point"] == ":input.0" and (first["step_a"], first["step_b"]) == (1, 2), first
