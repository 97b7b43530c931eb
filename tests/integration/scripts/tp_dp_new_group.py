"""Two data-parallel replicas of a hand-written TP=2 MLP over 4 ranks, with groups made by
``dist.new_group`` (no device mesh, no DTensor): each replica gets its own batch. ``--declare``
tells the tracer each process's TP group (``tensor_trace.tracer.set_tp_group``); without it the
TP group is the world and the replicas' points differ across it.

Run under torchrun with 4 processes (gloo); ``--tp-ranks 0,1/2,3`` (default) or ``0,2/1,3``."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit


class ColumnParallel(nn.Module):
    def __init__(self, w, rank, size):
        super().__init__()
        self.weight = nn.Parameter(w.chunk(size, 0)[rank].clone())

    def forward(self, x):
        return x @ self.weight.t()


class RowParallel(nn.Module):
    def __init__(self, w, rank, size, group):
        super().__init__()
        self.weight = nn.Parameter(w.chunk(size, 1)[rank].clone())
        self.group = group

    def forward(self, x):
        out = x @ self.weight.t()
        dist.all_reduce(out, group=self.group)
        return out


class MLP(nn.Module):
    def __init__(self, rank, size, group, dim=16, hidden=32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = ColumnParallel(torch.randn(hidden, dim, generator=g), rank, size)
        self.down = RowParallel(torch.randn(dim, hidden, generator=g), rank, size, group)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, rank, size, group):
        super().__init__()
        self.mlp = MLP(rank, size, group)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.mlp(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp-ranks", default="0,1/2,3")
    ap.add_argument("--declare", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp_ranks = [[int(r) for r in g.split(",")] for g in a.tp_ranks.split("/")]
    dp_ranks = [list(g) for g in zip(*tp_ranks)]
    tp_groups = [dist.new_group(g) for g in tp_ranks]  # every rank creates every group, in order
    for g in dp_ranks:
        dist.new_group(g)
    mine = next(i for i, g in enumerate(tp_ranks) if rank in g)
    if a.declare:
        from tensor_trace import tracer
        tracer.set_tp_group(tp_groups[mine])
    torch.manual_seed(0)
    model = Model(tp_ranks[mine].index(rank), len(tp_ranks[mine]), tp_groups[mine])
    with torch.no_grad():
        for step in range(a.steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * mine + step))
            model(x)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
