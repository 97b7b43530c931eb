"""examples/tp_llama.py run under ``torch.profiler.profile(record_shapes=True)`` (CPU activity):
the profiler variant of bench/record_cpu.py, started by torchrun in place of the example.

    torchrun --nproc-per-node 2 bench/profiled_example.py EXAMPLE_ARGS...

Each rank profiles its whole run (model build, steps, process-group teardown), as a user who
wraps the example's main would; nothing is exported (the profile is only collected)."""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from models import load_example  # bench/ is first on sys.path


def main() -> None:
    example = load_example()
    args = example.parse_args(sys.argv[1:])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
        example.run(args)


if __name__ == "__main__":
    main()
