"""A TP=2 model whose capture points reach a concatenation through clones, reshapes,  a split,
a dtype round trip, a copy by an op the tracer does not watch (matched by values) and an
in-place add. Run under torchrun
(gloo); ``--order`` picks which captures feed the head, ``--no-round-trip`` skips the copy,
``--rank1-order`` gives rank 1 other captures (a miswired rank)."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit


class Layer(nn.Module):
    def __init__(self, h, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(h, h)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(h, h, generator=g) * 0.1)
            self.proj.bias.zero_()

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class Head(nn.Module):
    def __init__(self, n, h):
        super().__init__()
        self.fc = nn.Linear(n * h, h)

    def forward(self, feats):
        return self.fc(feats)


class Model(nn.Module):
    def __init__(self, order, round_trip, h=8):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h, i) for i in range(4))
        self.head = Head(len(order), h)
        self.order, self.round_trip = order, round_trip

    def forward(self, x):
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        picked = []
        for i in self.order:
            t = outs[i].clone()                       # identity broken by a watched clone
            t = t.to(torch.float64).to(torch.float32)  # watched copies
            t = t.reshape(t.shape[0], 2, -1).reshape(t.shape[0], -1)
            if i == 1 and self.round_trip:
                t = t.neg().neg()                        # a copy by ops the tracer does not watch
            picked.append(t)
        both = torch.cat(picked, dim=-1)
        first, rest = both.split([8, both.shape[-1] - 8], dim=-1)
        feats = torch.cat([first, rest], dim=-1)
        dist.all_reduce(feats)                           # replicated inputs: same on every rank
        feats.div_(dist.get_world_size())
        return self.head(feats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="0,1,3")
    ap.add_argument("--no-round-trip", action="store_true")
    ap.add_argument("--rank1-order")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    order = args.rank1_order if args.rank1_order and dist.get_rank() == 1 else args.order
    model = Model([int(i) for i in order.split(",")], not args.no_round_trip).eval()
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for _ in range(2):
            model(torch.randn(3, 8, generator=g))
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
