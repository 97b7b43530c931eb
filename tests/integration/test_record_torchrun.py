"""`tensor-trace record -- torchrun --nproc-per-node N examples/tp_llama.py`: a real TP run on gloo.

One recording per world size (module-scoped fixture); each test checks one property of it.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tt_helpers import SMALL_MODEL, LAYERS, TORCHRUN, TP_LLAMA, load_traces, record_distributed, run_cmd

STEPS = 3
# tp_llama defaults (the run does not change them).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, BATCH, SEQ = 96, 6, 6, 16, 192, 384, 2, 8


def _torchrun(nproc, out_json):
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), TP_LLAMA, *SMALL_MODEL,
            "--steps", str(STEPS), "--out", str(out_json)]


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def tp_run(request, tmp_path_factory):
    nproc = request.param
    tmp = tmp_path_factory.mktemp(f"torchrun{nproc}")
    out_dir = tmp / "trace"
    res, _ = record_distributed(out_dir, _torchrun(nproc, tmp / "traced.json"))
    plain = run_cmd(_torchrun(nproc, tmp / "plain.json"), check=True)
    return dict(nproc=nproc, out_dir=out_dir, res=res, plain=plain, traces=load_traces(out_dir),
                traced_json=json.loads((tmp / "traced.json").read_text()),
                plain_json=json.loads((tmp / "plain.json").read_text()))


def test_one_rank_file_per_rank_and_none_for_the_launcher(tp_run):
    n = tp_run["nproc"]
    traces = tp_run["traces"]
    assert len(traces) == n, [t.path for t in traces]
    assert [t.rank for t in traces] == list(range(n))
    for t in traces:
        assert t.identity["world_size"] == n
        assert t.identity["local_rank"] == t.rank
        assert t.identity.get("backend") == "gloo"
        assert os.path.basename(t.header["argv"][0]) == "tp_llama.py", t.header["argv"]
        assert t.end is not None and t.end["reason"] == "exit", t.end
        assert not t.report.problems() and not t.errors
        assert sorted(t.steps) == list(range(STEPS))
    # No file for the torchrun agent: every file's process is a worker, children of one agent.
    pids = {t.header["pid"] for t in traces}
    ppids = {t.header["ppid"] for t in traces}
    assert len(pids) == n and len(ppids) == 1 and not pids & ppids


def _expected_paths():
    paths = {"", "model", "model.embed_tokens", "model.norm", "lm_head", "draft", "draft.fc", "draft.norm"}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        paths |= {p, f"{p}.input_layernorm", f"{p}.self_attn", f"{p}.self_attn.qkv_proj",
                  f"{p}.self_attn.attn", f"{p}.self_attn.o_proj", f"{p}.post_attention_layernorm",
                  f"{p}.mlp", f"{p}.mlp.gate_up_proj", f"{p}.mlp.act_fn", f"{p}.mlp.down_proj"}
    return paths


def test_module_paths_classes_and_tree(tp_run):
    for t in tp_run["traces"]:
        for step in t.steps.values():
            assert step.root == "" and step.t_end is not None
            paths = [s.path for s in step.spans]
            assert len(paths) == len(set(paths)), "each module is called once per step"
            assert set(paths) == _expected_paths()
            by_path = {s.path: s for s in step.spans}
            by_index = {s.index: s for s in step.spans}
            assert sorted(by_index) == list(range(len(step.spans)))
            assert by_path[""].parent == -1 and by_path[""].cls == "TinyLlamaForCausalLM"
            assert by_path["model.layers.0.self_attn.qkv_proj"].cls == "QKVParallelLinear"
            assert by_path["model.layers.1.mlp.down_proj"].cls == "RowParallelLinear"
            assert by_path["draft.fc"].cls == "Linear"
            for s in step.spans:
                if s.path:  # the parent of a.b.c is a.b (or the root for top-level modules)
                    parent = by_index[s.parent].path
                    assert parent == s.path.rpartition(".")[0] or (
                        parent == "" and "." not in s.path) or (
                        parent == "model" and s.path.startswith("model.layers.") and s.path.count(".") == 2), \
                        (s.path, parent)


def test_shapes_and_dtypes(tp_run):
    tp = tp_run["nproc"]
    for t in tp_run["traces"]:
        for step in t.steps.values():
            by_path = {s.path: s for s in step.spans}

            def out(path):
                outs = [x for x in by_path[path].tensors if x.slot == "output"]
                assert len(outs) == 1, (path, by_path[path].tensors)
                return outs[0]

            for s in step.spans:
                for x in s.tensors:
                    assert x.device == "cpu"
                    if x.slot == "input.0" and s.path in ("", "model", "model.embed_tokens"):
                        assert x.dtype == "int64" and x.shape == [BATCH, SEQ]
                    else:
                        assert x.dtype == "float32", (s.path, x)
            for i in range(LAYERS):
                p = f"model.layers.{i}"
                assert out(f"{p}.self_attn.qkv_proj").shape == [BATCH, SEQ, (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp]
                assert out(f"{p}.mlp.gate_up_proj").shape == [BATCH, SEQ, 2 * FFN // tp]
                assert out(f"{p}.mlp.act_fn").shape == [BATCH, SEQ, FFN // tp]
                assert out(f"{p}.self_attn.o_proj").shape == [BATCH, SEQ, HIDDEN]
                assert out(f"{p}.mlp.down_proj").shape == [BATCH, SEQ, HIDDEN]
                assert [x.shape for x in by_path[f"{p}.self_attn.attn"].tensors] == \
                    [[BATCH, SEQ, HEADS * HEAD_DIM // tp]] * 4
            assert out("model.embed_tokens").shape == [BATCH, SEQ, HIDDEN]
            assert out("lm_head").shape == [BATCH, SEQ, VOCAB // tp]
            root_out = [x for x in by_path[""].tensors if x.slot.startswith("output")]
            assert [(x.slot, x.shape) for x in root_out] == [("output.0", [BATCH, SEQ, VOCAB]),
                                                            ("output.1", [BATCH, SEQ, HIDDEN])]


def test_collectives_per_step(tp_run):
    tp = tp_run["nproc"]
    for t in tp_run["traces"]:
        assert t.end["stats"]["collectives"] == STEPS * (2 + 2 * LAYERS)
        for step in t.steps.values():
            spans = {s.index: s for s in step.spans}
            ops = [c.op for c in step.collectives]
            assert ops.count("all_reduce") == 1 + 2 * LAYERS, ops
            assert ops.count("all_gather") == 1 and len(ops) == 2 + 2 * LAYERS, ops
            assert ops[-1] == "all_gather"
            assert [c.index for c in step.collectives] == list(range(len(ops)))
            for c in step.collectives:
                parent = spans[c.parent].path
                assert c.flags == 0
                if c.op == "all_reduce":
                    assert c.reduce_op == "sum"
                    assert parent == "model.embed_tokens" or parent.endswith(
                        (".self_attn.o_proj", ".mlp.down_proj")), parent
                    assert [(x.slot, x.shape) for x in c.tensors] == [("input.0", [BATCH, SEQ, HIDDEN]),
                                                                     ("output.0", [BATCH, SEQ, HIDDEN])]
                    assert c.bytes == BATCH * SEQ * HIDDEN * 4
                else:
                    assert parent == "" and c.reduce_op is None
                    shard = [BATCH, SEQ, VOCAB // tp]
                    assert [(x.slot, x.shape) for x in c.tensors] == \
                        [("input.0", shard)] + [(f"output.{i}", shard) for i in range(tp)]
            embed = [c for c in step.collectives if spans[c.parent].path == "model.embed_tokens"]
            assert len(embed) == 1 and embed[0].index == 0
        for gid, g in t.groups.items():
            assert g["ranks"] == list(range(tp)) and g["backend"] == "gloo"


def test_all_reduce_fingerprints_add_up_across_ranks(tp_run):
    traces = tp_run["traces"]
    for step in range(STEPS):
        per_rank = [t.steps[step].collectives for t in traces]
        for calls in zip(*per_rank):
            assert len({c.op for c in calls}) == 1
            if calls[0].op != "all_reduce":
                continue
            ins = [c.tensors[0].fp for c in calls]
            outs = [c.tensors[1].fp for c in calls]
            assert all(fp is not None for fp in ins + outs)
            # the reduced result is the same on every rank
            assert all(_same_values(c.tensors[1], calls[0].tensors[1]) for c in calls), outs
            total = math.fsum(fp[0] for fp in ins)
            scale = max(abs(outs[0][0]), math.fsum(abs(fp[0]) for fp in ins))
            assert abs(total - outs[0][0]) <= 1e-4 * scale + 1e-6, (step, calls[0].index, ins, outs[0])
            # and the partial sums really differ between ranks (not one tensor seen n times)
            assert len({fp[0] for fp in ins}) > 1
        # the all_gather output (the full logits) is identical on every rank, and its shards are
        # the ranks' inputs in rank order
        gathers = [[c for c in cs if c.op == "all_gather"][0] for cs in per_rank]
        for g in gathers:
            assert all(_same_values(x, y) for x, y in zip(g.tensors[1:], gathers[0].tensors[1:]))
        assert all(_same_values(x, g.tensors[0]) for x, g in zip(gathers[0].tensors[1:], gathers))


def _same_values(x, y) -> bool:
    """Two recorded tensors hold the same values: equal fingerprints within the merge's tolerance.
    Not to the bit: ranks switch to tracer/native.py's C reads (another summation order than
    numpy's) at the first step that finds the extension ready, which need not be the same step
    on every rank (its load runs beside the first traced step)."""
    from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal

    return fp_equal(Observed(x.shape, x.dtype, x.fp), Observed(y.shape, y.dtype, y.fp))


def test_sequence_numbers_agree_across_ranks(tp_run):
    traces = tp_run["traces"]
    per_rank = []
    for t in traces:
        seqs = []
        for step in sorted(t.steps):
            for c in t.steps[step].collectives:
                g = t.groups[c.group]
                seqs.append((step, c.index, c.op, g["name"], tuple(g["ranks"]), c.seq))
        per_rank.append(seqs)
    assert all(s == per_rank[0] for s in per_rank)
    # consecutive within the group: the runs call nothing else on it during the steps
    seq = [s[-1] for s in per_rank[0]]
    assert seq == list(range(seq[0], seq[0] + len(seq)))


def test_traced_results_equal_untraced(tp_run):
    traced, plain = tp_run["traced_json"], tp_run["plain_json"]
    assert traced["tp"] == plain["tp"] == tp_run["nproc"]
    assert len(traced["steps"]) == STEPS
    assert traced.keys() == plain.keys()
    assert traced["steps"] == plain["steps"]  # same logits_sum, draft_sum and argmax, exactly
    assert len(traced["step_wall_s"]) == STEPS  # (times differ from run to run)
    # and the trace saw the same values: the root's first output is the gathered logits
    rank0 = tp_run["traces"][0]
    for rec in traced["steps"]:
        root = [s for s in rank0.steps[rec["step"]].spans if s.path == ""][0]
        logits = [x for x in root.tensors if x.slot == "output.0"][0]
        assert logits.fp[0] == pytest.approx(rec["logits_sum"], rel=1e-5, abs=1e-4)


def test_summary_on_stderr(tp_run):
    err = tp_run["res"].stderr
    n = tp_run["nproc"]
    spans = sum(len(s.spans) for t in tp_run["traces"] for s in t.steps.values())
    assert f"tensor-trace: {n} rank(s) in {n} traced process(es)" in err, err
    assert f"{spans} module spans" in err
    assert f"files: {tp_run['out_dir']}" in err
