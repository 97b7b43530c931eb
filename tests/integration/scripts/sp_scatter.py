"""Megatron's sequence-parallel entry: a whole embedding output, transposed to [s, b, h], and
each rank's own sequence part taken by a local slice (``scatter_to_sequence_parallel_region``:
no collective); then a norm on the part, and an all_gather of the parts back. With
``--same-part`` every rank takes the first part (a slice the same everywhere: whole).

Run under torchrun with 2 processes (gloo)."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit


class Embedding(nn.Module):
    def __init__(self, same_part: bool):
        super().__init__()
        self.word = nn.Embedding(32, 16)
        self.same_part = same_part

    def forward(self, ids):  # [b, s] -> this rank's [s / n, b, h]
        x = self.word(ids).transpose(0, 1).contiguous()
        n, r = dist.get_world_size(), 0 if self.same_part else dist.get_rank()
        part = x.shape[0] // n
        return x[r * part:(r + 1) * part].clone()


class Model(nn.Module):
    def __init__(self, same_part: bool):
        super().__init__()
        self.embedding = Embedding(same_part)
        self.norm = nn.LayerNorm(16)
        with torch.no_grad():  # (not unit weights: a normed row's sum and sum of squares would be the same on any rank)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, ids):
        h = self.norm(self.embedding(ids))
        whole = torch.empty((h.shape[0] * dist.get_world_size(), *h.shape[1:]))
        dist.all_gather_into_tensor(whole, h)
        return whole


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--same-part", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model(a.same_part)
    with torch.no_grad():
        for step in range(a.steps):
            model(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step)))
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
