"""What naming a shared module by its call site costs per call (tracer/naming.py ``call_site``).

    python bench/shared_modules.py [--rounds 11] [--steps 30]

bench/call_patterns.py's SGLang-signature decode step (32 layers) as it is (a rotary module per
layer) and with one rotary module held by every layer (as SGLang's get_rope caches it), traced
without fingerprints, interleaved rounds: the difference per step over the 32 rotary calls is
what a shared module's call pays for being named per call.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import call_patterns as cp  # noqa: E402

from tensor_trace import tracer  # noqa: E402
from tensor_trace.tracer import tensor_slots  # noqa: E402


def block(step, steps: int) -> float:
    tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-shared-"), fingerprint=False, lineage=False)
    try:
        for _ in range(3):
            step()
        c0 = time.process_time_ns()
        for _ in range(steps):
            step()
        return (time.process_time_ns() - c0) / steps / 1e6
    finally:
        tracer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tensor_slots.CONTEXT_TYPES.add(cp.ForwardBatch)
    own, shared = cp.SGLangCalls().eval(), cp.SGLangCalls().eval()
    rotary = shared.model.layers[0].self_attn.rotary_emb
    for layer in shared.model.layers:
        layer.self_attn.rotary_emb = rotary
    ids, pos, fb = torch.randint(0, 100, (cp.B,)), torch.arange(cp.B), cp.forward_batch()
    models = {"own": lambda: own(ids, pos, fb), "shared": lambda: shared(ids, pos, fb)}
    res = {m: [] for m in models}
    diffs = []
    rng = random.Random(0)
    with torch.inference_mode():
        for _ in range(args.rounds):
            order = list(models)
            rng.shuffle(order)
            got = {m: block(models[m], args.steps) for m in order}
            for m in models:
                res[m].append(got[m])
            diffs.append((got["shared"] - got["own"]) * 1e3 / cp.L)
    q = statistics.quantiles(diffs, n=4)
    print(f"# shared_modules {time.strftime('%Y-%m-%d %H:%M')} torch={torch.__version__} rounds={args.rounds} "
          f"steps={args.steps} (CPU time, one thread; load {os.getloadavg()[0]:.1f})")
    print(f"cpu ms/step median: a rotary per layer {statistics.median(res['own']):.3f}, one shared "
          f"{statistics.median(res['shared']):.3f}; per shared call, paired: median "
          f"{statistics.median(diffs):+.2f} us [p25 {q[0]:+.2f}, p75 {q[2]:+.2f}]; minima (least disturbed "
          f"rounds) {min(res['own']):.3f} and {min(res['shared']):.3f} ms: "
          f"{(min(res['shared']) - min(res['own'])) * 1e3 / cp.L:+.2f} us per shared call")


if __name__ == "__main__":
    main()
