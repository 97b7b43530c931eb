"""A torchtitan-style Llama on PyTorch's own TP API, for the functional-collective tests: the model
and plans of tp_api_llama.py, with real-valued rotary tables.

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

import tp_api_llama
from tp_api_llama import SIZES, tokens_for_step
import clean_exit

def transformer(**sizes):
    """tp_api_llama's Transformer with real-valued rotary tables."""
    return tp_api_llama.Transformer(**sizes, rotary="real")


def parallelize(model, mesh, plan):
    """tp_api_llama's ``plain`` or ``sp``; the plain plan's head gathers its logits too."""
    if plan == "plain":
        return tp_api_llama.parallelize(model, mesh, plan, output=ColwiseParallel(output_layouts=Replicate()))
    return tp_api_llama.parallelize(model, mesh, plan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=("plain", "sp"), default="plain")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = parallelize(transformer(**SIZES).eval(), mesh, a.plan)
    with torch.no_grad():
        for step in range(a.steps):
            out = model(tokens_for_step(step))
    if dist.get_rank() == 0:
        print("ok", a.plan, tuple(out.shape), flush=True)
    clean_exit.destroy_process_group()  # (clean_exit.py: a race in torch at exit)


if __name__ == "__main__":
    main()
