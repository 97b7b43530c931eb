"""A torchtitan-style Llama on PyTorch's own TP API, for the functional-collective tests.

The ParallelStyles issue every collective through DTensor redistributions, i.e. functional
collectives whose results are AsyncCollectiveTensors waited later:

- ``--plan plain``: RowwiseParallel ``tok_embeddings`` (vocab-parallel: all_reduce), ColwiseParallel
  q/k/v/w1/w3, RowwiseParallel wo/w2 (all_reduce of each output), ColwiseParallel head whose
  logits are all-gathered along the vocabulary.
- ``--plan sp``: sequence parallel: the embedding, wo and w2 reduce-scatter along the sequence
  (dim 1), SequenceParallel norms, PrepareModuleInput all-gathers attention's and feed_forward's
  inputs along dim 1 (funcol does dims other than 0 by chunk and cat around a dim-0 op).

Rotary embeddings are real-valued (cos/sin buffers) so that nothing here depends on how complex
tensors are fingerprinted. Run under torchrun on gloo:

    torchrun --nproc-per-node 2 funcol_tp.py --plan sp --steps 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

SIZES = dict(vocab=96, dim=48, layers=2, heads=6, hidden=96, seq=12, batch=2)


def rotary_tables(head_dim, seq):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.hd = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, l, _ = x.shape
        q, k, v = (t.view(b, l, -1, self.hd) for t in (self.wq(x), self.wk(x), self.wv(x)))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, l, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, layers, heads, hidden, seq, **_):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(dim // heads, seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))


def parallelize(model, mesh, plan):
    sp = plan == "sp"
    if sp:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
               "norm": SequenceParallel(),
               "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    else:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
               "output": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        row = (lambda: RowwiseParallel(output_layouts=Shard(1))) if sp else RowwiseParallel
        styles = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                  "attention.wv": ColwiseParallel(), "attention.wo": row(),
                  "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": row(),
                  "feed_forward.w3": ColwiseParallel()}
        if sp:
            styles.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, styles)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=("plain", "sp"), default="plain")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = parallelize(Transformer(**SIZES).eval(), mesh, a.plan)
    with torch.no_grad():
        for step in range(a.steps):
            g = torch.Generator().manual_seed(1000 + step)
            out = model(torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"]), generator=g))
    if dist.get_rank() == 0:
        print("ok", a.plan, tuple(out.shape), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
