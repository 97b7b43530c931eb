"""Recording options: --steps A:B, --module GLOB, --no-fingerprint."""

from __future__ import annotations

import fnmatch

from tt_helpers import (LAYERS, PYTHON, SMALL_MODEL, TORCHRUN, TP_LLAMA, load_traces, record,
                        record_distributed)

PER_STEP = 2 + 2 * LAYERS  # collectives per step with tp > 1


def _torchrun(steps):
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", TP_LLAMA, *SMALL_MODEL, "--steps", str(steps)]


def test_steps_window_records_exactly_those_steps(tmp_path):
    out = tmp_path / "trace"
    res, _ = record_distributed(out, _torchrun(4), "--steps", "1:3")
    assert res.stdout.count("logits_sum=") == 4  # the program ran all its steps
    traces = load_traces(out)
    assert [t.rank for t in traces] == [0, 1]
    for t in traces:
        assert sorted(t.steps) == [1, 2]
        assert t.header["config"]["steps"] == [1, 3]
        assert t.end["reason"] == "exit"
        # step 0 skipped; after step 2 the window is behind for good, and nothing counts step 3
        # (Tracer.go_dormant)
        assert t.end["stats"]["steps"] == 2 and t.end["stats"]["steps_skipped"] == 1
        assert t.end["stats"]["dormant_after_step"] == 2
        for n, step in t.steps.items():
            assert step.t_end is not None and step.root == ""
            assert len(step.spans) == len(t.steps[1].spans) > 20
            assert all(s.step == n for s in step.spans)
            assert len(step.collectives) == PER_STEP
            # sequence numbers count the untraced step 0 too, so ranks agree whatever the window
            assert [c.seq for c in step.collectives] == list(range(n * PER_STEP, (n + 1) * PER_STEP))
    assert [[(c.op, c.seq) for c in t.steps[1].collectives] for t in traces][0] == \
        [[(c.op, c.seq) for c in t.steps[1].collectives] for t in traces][1]


def test_module_glob_records_only_matching_spans(tmp_path):
    out = tmp_path / "trace"
    record(out, [PYTHON, TP_LLAMA, *SMALL_MODEL, "--steps", "2"], "--module", "model.layers.0.*", timeout=60)
    (t,) = load_traces(out)
    assert sorted(t.steps) == [0, 1]
    expected = {"", "model.layers.0.input_layernorm", "model.layers.0.self_attn",
                "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.attn",
                "model.layers.0.self_attn.o_proj", "model.layers.0.post_attention_layernorm",
                "model.layers.0.mlp", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.act_fn",
                "model.layers.0.mlp.down_proj"}
    for step in t.steps.values():
        paths = [s.path for s in step.spans]
        assert set(paths) == expected and len(paths) == len(expected)
        assert all(p == "" or fnmatch.fnmatchcase(p, "model.layers.0.*") for p in paths)
        # indices are dense and parents point at recorded spans: the nearest recorded ancestor
        by_index = {s.index: s for s in step.spans}
        assert sorted(by_index) == list(range(len(paths)))
        for s in step.spans:
            if s.path == "":
                assert s.parent == -1
            elif s.path.count(".") == 3:  # model.layers.0.X: its recorded ancestor is the root
                assert by_index[s.parent].path == ""
            else:
                assert by_index[s.parent].path == s.path.rpartition(".")[0]
    assert t.header["config"]["modules"] == ["model.layers.0.*"]


def test_no_fingerprint_records_no_values(tmp_path):
    out = tmp_path / "trace"
    record_distributed(out, _torchrun(2), "--no-fingerprint")
    traces = load_traces(out)
    assert [t.rank for t in traces] == [0, 1]
    for t in traces:
        assert t.header["config"]["fingerprint"] is False
        assert sorted(t.steps) == [0, 1]
        n_tensors = 0
        for step in t.steps.values():
            assert not step.fingerprints
            assert len(step.collectives) == PER_STEP and len(step.spans) > 20
            for item in (*step.spans, *step.collectives):
                assert item.tensors, item  # shapes and dtypes are still recorded
                assert all(ref == -1 for ref in item.fp_refs)
                for x in item.tensors:
                    assert x.fp is None and x.shape and x.dtype in ("float32", "int64")
                    n_tensors += 1
        assert n_tensors > 100
