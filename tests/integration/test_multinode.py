"""One run across nodes: two ``tensor-trace record`` invocations on this machine act as two nodes
of ``torchrun --nnodes 2`` (c10d rendezvous on loopback, gloo, one rank per node). Node 1's rank
runs with its clock shifted and a host name of its own (the test shim tests/integration/clock_shift).
The c10d rendezvous need not give node 1 rank 1: the checks find the shifted rank by its host.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import pytest

from tt_helpers import DEFAULT_TIMEOUT, ROOT, SMALL_MODEL, TORCHRUN, TP_LLAMA, base_env, record, record_cmd, stop_tree, tt

SHIFT_NS = 3_000_000_000  # node 1's clock runs 3 s ahead
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clock_shift")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out_dirs, *options, rdzv_id="tt-multinode"):
    """Start both nodes' ``record -- torchrun --nnodes 2 --node-rank K``; wait for both."""
    port = _free_port()
    procs = []
    for node, out_dir in enumerate(out_dirs):
        cmd = [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
               "--max-restarts", "0", TP_LLAMA, *SMALL_MODEL, "--steps", "2"]
        env = base_env(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
        if node == 1:
            env.update(TEST_CLOCK_SHIFT_NS=f"*:{SHIFT_NS}", TEST_HOSTNAME="node1",
                       PYTHONPATH=os.pathsep.join(filter(None, [SHIM, env.get("PYTHONPATH")])))
        procs.append(subprocess.Popen(record_cmd(out_dir, cmd, *options), cwd=str(ROOT), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=DEFAULT_TIMEOUT)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                stop_tree(p)
    for code, out, err in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return results


def _sql(trace, query):
    r = tt("query", "sql", query, "--trace", str(trace), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _check_one_run(trace):
    procs = _sql(trace, "SELECT rank, host, run_id, clock_offset_ns, clock_residual_ns, clock_matches "
                        "FROM processes ORDER BY rank")
    assert [p["rank"] for p in procs] == [0, 1]
    assert len({p["run_id"] for p in procs}) == 1 and procs[0]["run_id"] == "tt-multinode"
    shifted, = (p for p in procs if p["host"] == "node1")
    other, = (p for p in procs if p["host"] != "node1")
    # The skew estimated from the collectives is the injected shift, within 50 ms (offsets are
    # relative to rank 0, whichever node it is on).
    assert procs[0]["clock_offset_ns"] == 0
    assert abs(shifted["clock_offset_ns"] - other["clock_offset_ns"] + SHIFT_NS) < 50_000_000, procs
    assert procs[1]["clock_matches"] >= 5 and procs[1]["clock_residual_ns"] < 50_000_000
    # Aligned, the cross-node collectives line up: both ranks leave each blocking all_reduce at
    # about the same time (3 s apart before alignment).
    ends = _sql(trace, "SELECT seq, MAX(start_ns + dur_ns) - MIN(start_ns + dur_ns) AS spread, COUNT(*) AS n "
                       "FROM collective_view GROUP BY grp, seq")
    assert ends and all(e["n"] == 2 for e in ends)
    assert sorted(e["spread"] for e in ends)[len(ends) // 2] < 50_000_000, ends
    # Verdicts as at TP=2 on one node.
    r = tt("query", "reduction", "model.embed_tokens", "--trace", str(trace), "--json")
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)
    assert (verdict["verdict"], verdict["placement"]) == ("post-reduction", "replicate")


def test_node_folders_merge_into_one_run(tmp_path):
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    _two_nodes(node_dirs)  # the run id comes from torchrun's --rdzv-id
    r = tt("merge", str(node_dirs[0]), str(node_dirs[1]))
    assert r.returncode == 0, r.stderr
    assert "gathered 1 rank file(s)" in r.stdout and "hosts: " in r.stdout
    reported = [abs(float(ms)) for ms in re.findall(r"clock: process \d+ offset ([-+][\d.]+) ms", r.stdout)]
    assert any(abs(ms - SHIFT_NS / 1e6) < 50 for ms in reported), r.stdout
    _check_one_run(node_dirs[0])


def test_nodes_share_one_folder(tmp_path):
    shared = tmp_path / "shared"
    _two_nodes([shared, shared], "--run-id", "tt-multinode", rdzv_id="other-rdzv")
    r = tt("merge", str(shared))
    assert r.returncode == 0, r.stderr
    _check_one_run(shared)


def test_other_runs_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, run_id in ((a, "run-a"), (b, "run-b")):
        record(d, ["python", "-c", "pass"], "--run-id", run_id)
    # A folder of another run id is refused, one of the same id joined.
    refused = tt("record", "-o", str(a), "--run-id", "run-b", "--", "python", "-c", "pass")
    assert refused.returncode == 2 and "already holds a recorded run" in refused.stderr
    assert tt("record", "-o", str(a), "--run-id", "run-a", "--", "python", "-c", "pass").returncode == 0
    r = tt("merge", str(a), str(b))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "records run run-b, not" in r.stderr, r.stderr
    assert not (a / "merged.sqlite").exists()
