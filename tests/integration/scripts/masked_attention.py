"""A tensor-parallel attention layer handed an additive causal mask as HuggingFace transformers'
eager attention builds it: 0 where a position may attend, ``torch.finfo(dtype).min`` where not
(``--mask-value -inf``: a true -inf, as ``masked_fill(-inf)`` gives). The model builds the mask
once per step and passes it to every layer by keyword. Column-parallel q/k/v (heads split),
row-parallel o, an all_reduce of o's partial sums.

Run under torchrun with 2 processes (gloo)."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit

HIDDEN, HEADS, VOCAB = 32, 4, 64


class Attention(nn.Module):
    def __init__(self, tp: int, rank: int):
        super().__init__()
        self.heads, self.hd = HEADS // tp, HIDDEN // HEADS
        full_q, full_k, full_v, full_o = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        part = HIDDEN // tp
        self.q, self.k, self.v = (nn.Linear(HIDDEN, part, bias=False) for _ in range(3))
        self.o = nn.Linear(part, HIDDEN, bias=False)
        with torch.no_grad():
            for mine, full in ((self.q, full_q), (self.k, full_k), (self.v, full_v)):
                mine.weight.copy_(full.weight[rank * part:(rank + 1) * part])
            self.o.weight.copy_(full_o.weight[:, rank * part:(rank + 1) * part])

    def forward(self, x, attention_mask=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / self.hd ** 0.5 + attention_mask
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, self.heads * self.hd)
        out = self.o(out)
        dist.all_reduce(out)
        return out


class Layer(nn.Module):
    def __init__(self, tp: int, rank: int):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention(tp, rank)

    def forward(self, x, attention_mask=None):
        return x + self.attn(self.norm(x), attention_mask=attention_mask)


class Model(nn.Module):
    def __init__(self, tp: int, rank: int, mask_value: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(tp, rank) for _ in range(2))
        self.mask_value = mask_value

    def forward(self, ids):
        s = ids.shape[1]
        low = torch.finfo(torch.float32).min if self.mask_value == "min" else float("-inf")
        mask = torch.full((s, s), low).triu(1)[None, None]  # [1, 1, s, s]
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask)
        return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mask-value", choices=("min", "inf"), default="min")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model(dist.get_world_size(), dist.get_rank(), a.mask_value)
    with torch.no_grad():
        for step in range(a.steps):
            model(torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step)))
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
