"""A torchtitan-style Llama on PyTorch's TP API (DTensor), sequence parallel by default.

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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))


class Attention(nn.Module):
    def __init__(self, dim, nh):
        super().__init__()
        self.hd = dim // nh
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        b, seq, _ = x.shape
        q, k, v = (w(x).view(b, seq, -1, self.hd) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, k, freqs_cis)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, nh, hidden):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, nh)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab=96, dim=48, layers=2, nh=6, hidden=96, seq=12):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, nh, hidden) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // nh, seq), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def parallelize(model, mesh, sp, local_out):
    seq = Shard(1) if sp else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=local_out)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for blk in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                         desired_input_layouts=(Replicate(), None)),
                         "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                            desired_input_layouts=(Replicate(),))})
        parallelize_module(blk, mesh, plan)


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
    model = Transformer()
    parallelize(model, mesh, not a.no_sp, not a.dtensor_out)
    truth = {"outputs": [], "params": []}
    for path, sub in model.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                truth["params"].append([path, name, *_values(p.detach())])
    watch(model, truth)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(a.steps):
            out = model(tokens)
    os.makedirs(a.truth_dir, exist_ok=True)
    with open(os.path.join(a.truth_dir, f"rank{rank}.json"), "w") as f:
        json.dump(truth, f)
    dist.destroy_process_group()
