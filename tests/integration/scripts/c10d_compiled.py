"""A hand-written (Megatron-style) tensor-parallel MLP whose row-parallel half calls c10d's
``dist.all_reduce`` inside blocks compiled with ``torch.compile`` (dynamo turns it into a
functional collective of the graph). ``TT_FULLGRAPH=1`` compiles with ``fullgraph=True``
(a graph break, as the tracer's wrapper would cause if dynamo traced into it, is an error).
``TT_COMPILE=down`` compiles the row-parallel modules alone, which end with their all_reduce,
instead of the blocks; ``TT_COMPILE_BACKEND`` picks the backend (``aot_eager`` by default).

    torchrun --nproc-per-node 2 c10d_compiled.py DUMP_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import clean_exit

D, F, STEPS = 32, 64, 3


class ColumnParallel(nn.Module):
    def __init__(self, tp, rank):
        super().__init__()
        w = torch.randn(F, D, generator=torch.Generator().manual_seed(1))
        self.w = nn.Parameter(w[rank * F // tp:(rank + 1) * F // tp].clone())

    def forward(self, x):
        return x @ self.w.t()


class RowParallel(nn.Module):
    def __init__(self, tp, rank):
        super().__init__()
        w = torch.randn(D, F, generator=torch.Generator().manual_seed(2))
        self.w = nn.Parameter(w[:, rank * F // tp:(rank + 1) * F // tp].clone())

    def forward(self, h):
        y = h @ self.w.t()
        dist.all_reduce(y)
        return y


class Block(nn.Module):
    def __init__(self, tp, rank):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), ColumnParallel(tp, rank), RowParallel(tp, rank)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, tp, rank):
        super().__init__()
        self.layers = nn.ModuleList([Block(tp, rank) for _ in range(2)])
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Model(tp, rank)
    fullgraph = os.environ.get("TT_FULLGRAPH") == "1"
    backend = os.environ.get("TT_COMPILE_BACKEND", "aot_eager")
    for i, block in enumerate(model.layers):
        if os.environ.get("TT_COMPILE") == "down":
            block.down = torch.compile(block.down, backend=backend, fullgraph=fullgraph)
        else:
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
    outs = []
    with torch.no_grad():
        for step in range(STEPS):
            outs.append(model(torch.randn(4, D, generator=torch.Generator().manual_seed(10 + step))))
    torch.save(outs, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    clean_exit.destroy_process_group()


if __name__ == "__main__":
    main()
