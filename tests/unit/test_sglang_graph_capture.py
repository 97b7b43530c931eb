"""The bookkeeping around SGLang's CUDA-graph capture, without a GPU or SGLang: a stand-in graph
runner calls the model's forward itself, as SGLang's DecodeCudaGraphRunner does."""

import inspect

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files
from tensor_trace.tracer.integrations.sglang import patch_graph_capture


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.lm_head = nn.Linear(4, 8)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        return self.lm_head(self.model(input_ids))


class FakeRunner:  # what capture_one_shape needs: .model_runner.model
    def __init__(self, model):
        self.model_runner = type("MR", (), {"model": model})()

    def capture_one_shape(self, size, forward):
        assert "input_embeds" in inspect.signature(forward).parameters  # SGLang inspects it
        for _ in range(2):  # warm-up runs, then the captured run in SGLang
            forward(torch.randn(size, 4), None, None)
        return "graph"


def test_each_forward_of_a_capture_is_a_step_named_by_the_model(tmp_path):
    patch_graph_capture(FakeRunner, "decode")
    model = Model()
    tracer.start(out_dir=str(tmp_path))
    try:
        assert FakeRunner(model).capture_one_shape(3, model.forward) == "graph"
    finally:
        tracer.stop()
    rt = load_rank_file(rank_files(str(tmp_path))[0])
    assert sorted(rt.steps) == [0, 1]
    for st in rt.steps.values():
        assert st.attrs == {"forward_mode": "decode", "batch_size": 3, "cuda_graph": "capture"}
        assert {s.path for s in st.spans} == {"", "model", "model.0", "model.1", "lm_head"}
