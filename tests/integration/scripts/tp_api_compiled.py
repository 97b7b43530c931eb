"""tp_api_llama.py with each transformer block compiled, as torchtitan compiles its blocks
(``torch.compile`` per block, after the TP plan is applied): the DTensor redistributions inside a
block are traced by torch.compile and run inside the compiled graph. Same command line as
tp_api_llama.py; ``TT_COMPILE_BACKEND`` picks the backend (default ``aot_eager``: no C++
compile, the same tracing of the functional collectives as inductor's).

    torchrun --nproc-per-node 2 tp_api_compiled.py --plan plain --steps 3 [--dump DIR]
"""

import os

import torch

import tp_api_llama

_parallelize = tp_api_llama.parallelize


def parallelize(model, mesh, plan, **overrides):
    model = _parallelize(model, mesh, plan, **overrides)
    backend = os.environ.get("TT_COMPILE_BACKEND", "aot_eager")
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend=backend))
    return model


tp_api_llama.parallelize = parallelize

if __name__ == "__main__":
    tp_api_llama.main()
