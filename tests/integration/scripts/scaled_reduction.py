"""A row-parallel projection whose all_reduce output its caller scales by a number before the
next module (Granite's ``residual_multiplier``, MiniCPM's depth scale). Its weight's rows come
in +/- pairs, so every row of the reduced output sums to exactly zero, as dummy weights' sums
nearly do: the fingerprints cannot confirm the scale, the recorded op can.

Run under torchrun with 2 processes (gloo)."""

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit

HIDDEN, OUT = 8, 6


class Row(nn.Module):
    def __init__(self, tp: int, rank: int):
        super().__init__()
        half = torch.randn(OUT // 2, HIDDEN)
        full = torch.cat([half, -half])  # rows in +/- pairs: each output row sums to zero
        part = HIDDEN // tp
        self.weight = nn.Parameter(full[:, rank * part:(rank + 1) * part].clone(), requires_grad=False)

    def forward(self, x):
        y = x @ self.weight.T
        dist.all_reduce(y)
        return y


class Norm(nn.Module):
    def forward(self, h):
        return h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()


class Model(nn.Module):
    def __init__(self, tp: int, rank: int):
        super().__init__()
        self.rank, self.part = rank, HIDDEN // tp
        self.o_proj = Row(tp, rank)
        self.norm = Norm()

    def forward(self, x):
        out = self.o_proj(x[..., self.rank * self.part:(self.rank + 1) * self.part])
        return self.norm(out * 0.25)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model(dist.get_world_size(), dist.get_rank())
    with torch.no_grad():
        for step in range(3):
            model(torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(step)))
    clean_exit.destroy_process_group()


if __name__ == "__main__":
    main()
