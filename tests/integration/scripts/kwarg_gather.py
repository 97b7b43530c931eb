"""A head whose keyword input is gathered by PyTorch's TP API before its call
(``PrepareModuleInput(input_kwarg_layouts={"h": Shard(1)}, desired_input_kwarg_layouts={"h":
Replicate()})``): each rank passes its slice of the sequence as ``h=``.

    torchrun --nproc-per-node 2 kwarg_gather.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

import clean_exit


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, *, h):
        return self.proj(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = Head()

    def forward(self, x):
        return self.head(h=self.body(x))


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model()
    parallelize_module(model.head, mesh, PrepareModuleInput(
        input_kwarg_layouts={"h": Shard(1)}, desired_input_kwarg_layouts={"h": Replicate()}, use_local_output=True))
    full = torch.randn(2, 4 * dist.get_world_size(), 8, generator=torch.Generator().manual_seed(1))
    mine = full.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
    with torch.no_grad():
        for _ in range(2):
            model(mine)
    clean_exit.destroy_process_group()


if __name__ == "__main__":
    main()
