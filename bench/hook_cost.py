"""Per-module-call cost of tracing, side by side in one run: no hooks, two empty global hooks
(the floor any hook-based tracer pays inside torch), the tracer without and with fingerprints,
each with its default ``Module.__call__`` wrapper and with global hooks (``intercept="hooks"``).

    python bench/hook_cost.py [--device cpu|cuda] [--modules 200] [--rounds 7]

A chain of N tiny modules (a Linear on a [4, 64] tensor) makes per-call costs visible; medians
over interleaved rounds; microseconds per module call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from tensor_trace import tracer


class Chain(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modules", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    net = Chain(args.modules).to(dev)
    x = torch.randn(4, 64, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run():
        for _ in range(5):
            net(x)
        sync()
        t = time.perf_counter_ns()
        for _ in range(args.steps):
            net(x)
        sync()
        return (time.perf_counter_ns() - t) / args.steps / (args.modules + 1) / 1e3

    def plain():
        return run()

    def empty():
        h = [nn_module.register_module_forward_pre_hook(lambda m, a: None),
             nn_module.register_module_forward_hook(lambda m, a, *r: None, with_kwargs=True, always_call=True)]
        try:
            return run()
        finally:
            for x_ in h:
                x_.remove()
                nn_module._global_forward_hooks_with_kwargs.pop(x_.id, None)  # torch leaves it

    def traced(fp, intercept="call"):
        def f():
            tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-hook-"), fingerprint=fp, intercept=intercept)
            try:
                return run()
            finally:
                tracer.stop()
        return f

    variants = {"plain": plain, "empty-hooks": empty, "traced-nofp": traced(False), "traced-fp": traced(True),
                "nofp-hooks": traced(False, "hooks"), "fp-hooks": traced(True, "hooks")}
    res = {k: [] for k in variants}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in variants.items():
                res[name].append(fn())
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"# hook_cost {time.strftime('%Y-%m-%d %H:%M')} device={dev} torch={torch.__version__} "
          f"modules={args.modules} rounds={args.rounds}")
    print(f"{'variant':12s} {'us/call':>8s} {'+us vs plain':>12s} {'min..max':>16s}")
    for k, v in med.items():
        print(f"{k:12s} {v:8.2f} {v - med['plain']:12.2f} {min(res[k]):7.2f}..{max(res[k]):<7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(dev), torch=torch.__version__, median_us=med, rounds=res), f, indent=1)


if __name__ == "__main__":
    main()
