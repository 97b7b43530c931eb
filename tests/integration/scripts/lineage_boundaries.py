"""A TP=2 target whose captures reach the draft heads through module boundaries. Run under
torchrun (gloo).

- ``target.forward`` concatenates the captured layer outputs itself and returns the result
  next to its logits (``draft_cat`` consumes it);
- ``packer`` (which owns the target) writes the same captures into slices of a preallocated
  buffer, as SGLang's AuxHiddenStatePacker does, by ``copy_`` into a slice, ``index_copy_`` and
  slice assignment, in the time order ``--write-order`` (slots, not layers); ``draft``'s fc
  consumes the buffer.

``--aux`` picks the captured layers, in slot order.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import clean_exit

H = 8


class ColumnLinear(nn.Module):
    def __init__(self, seed, tp, rank):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(2 * H, H, generator=g) * 0.3
        n = 2 * H // tp
        self.w = nn.Parameter(full[rank * n:(rank + 1) * n].clone())

    def forward(self, x):
        return x @ self.w.t()


class RowLinear(nn.Module):
    def __init__(self, seed, tp, rank):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(H, 2 * H, generator=g) * 0.3
        n = 2 * H // tp
        self.w = nn.Parameter(full[:, rank * n:(rank + 1) * n].clone())

    def forward(self, x):
        out = x @ self.w.t()
        dist.all_reduce(out)
        return out


class Layer(nn.Module):
    def __init__(self, i, tp, rank):
        super().__init__()
        self.up = ColumnLinear(10 + i, tp, rank)
        self.down = RowLinear(20 + i, tp, rank)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Target(nn.Module):
    def __init__(self, aux, tp, rank):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i, tp, rank) for i in range(4))
        self.aux = aux

    def forward(self, x):
        hs = []
        for layer in self.layers:
            x = layer(x)
            hs.append(x)
        return x, torch.cat([hs[i] for i in self.aux], dim=-1), tuple(hs)


class Packer(nn.Module):
    def __init__(self, target, write_order):
        super().__init__()
        self.target = target
        self.write_order = write_order

    def forward(self, x):
        last, aux_cat, hs = self.target(x)
        picked = [hs[i] for i in self.target.aux]
        buf = picked[0].new_empty(*picked[0].shape[:-1], H * len(picked))
        for slot in self.write_order:
            src = picked[slot]
            if slot % 3 == 0:
                buf[..., slot * H:(slot + 1) * H].copy_(src)
            elif slot % 3 == 1:
                buf.index_copy_(-1, torch.arange(slot * H, (slot + 1) * H), src)
            else:
                buf[..., slot * H:(slot + 1) * H] = src
        return last, aux_cat, buf


class Draft(nn.Module):
    def __init__(self, n):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.fc = nn.Linear(n * H, H, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(H, n * H, generator=g) * 0.1)

    def forward(self, feats):
        return self.fc(feats)


class Model(nn.Module):
    def __init__(self, aux, write_order, tp, rank):
        super().__init__()
        self.packer = Packer(Target(aux, tp, rank), write_order)
        self.draft_cat = Draft(len(aux))
        self.draft = Draft(len(aux))

    def forward(self, x):
        last, aux_cat, packed = self.packer(x)
        return last, self.draft_cat(aux_cat), self.draft(packed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--aux", default="0,1,3")
    ap.add_argument("--write-order", default="2,0,1")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    aux = [int(i) for i in args.aux.split(",")]
    order = [int(i) for i in args.write_order.split(",")]
    model = Model(aux, order, dist.get_world_size(), dist.get_rank()).eval()
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for _ in range(2):
            model(torch.randn(2, 3, H, generator=g))
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
