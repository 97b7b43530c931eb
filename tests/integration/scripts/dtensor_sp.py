"""A torchtitan-style Llama on PyTorch's TP API (DTensor), sequence parallel by default: the model
and plans of tp_api_llama.py (plan ``sp``, or ``plain`` with ``--no-sp``), its head gathering the
logits (``output_layouts=Replicate()``).

    torchrun --nproc-per-node N dtensor_sp.py TRUTH_DIR [--no-sp] [--dtensor-out] [--steps K]

Besides running, each rank writes TRUTH_DIR/rank{R}.json: what the tracer should have recorded
for every DTensor module output and DTensor parameter (local shape, sum and sum of squares of
the local tensor), computed by forward hooks of the program itself.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from tp_api_llama import SIZES, Transformer
from tp_api_llama import parallelize as parallelize_plan
import clean_exit


def parallelize(model, mesh, sp, local_out):
    """Plan ``sp`` (else ``plain``); only the head's ``use_local_output`` follows ``local_out``."""
    head = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate(),
                           use_local_output=local_out)
    return parallelize_plan(model, mesh, "sp" if sp else "plain", output=head)


def _values(t):
    local = t.to_local().float()
    return [list(local.shape), local.sum().item(), (local * local).sum().item()]


def watch(model, truth):
    """Forward hooks (registered after the TP plan's, so they see what the caller gets)."""
    step = [-1]
    calls: dict = {}

    def on_root(module, args):
        step[0] += 1
        calls.clear()

    def on_output(path):
        def hook(module, args, output):
            call = calls.get(path, 0)
            calls[path] = call + 1
            if isinstance(output, DTensor):
                truth["outputs"].append([step[0], path, call, *_values(output)])
        return hook

    model.register_forward_pre_hook(on_root)
    for path, sub in model.named_modules():
        sub.register_forward_hook(on_output(path))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("truth_dir")
    ap.add_argument("--no-sp", action="store_true")
    ap.add_argument("--dtensor-out", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Transformer(**SIZES)
    parallelize(model, mesh, not a.no_sp, not a.dtensor_out)
    truth = {"outputs": [], "params": []}
    for path, sub in model.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                truth["params"].append([path, name, *_values(p.detach())])
    watch(model, truth)
    tokens = torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"]),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(a.steps):
            out = model(tokens)
    os.makedirs(a.truth_dir, exist_ok=True)
    with open(os.path.join(a.truth_dir, f"rank{rank}.json"), "w") as f:
        json.dump(truth, f)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)
