"""Where fingerprint time goes on a GPU: per-call costs of the pieces, side by side.

    python bench/fp_probe.py [--n 400] [--shape 8 4096]
"""

import argparse
import time

import torch

from tensor_trace.tracer.fingerprint import StepFingerprints


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter_ns()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t) / reps / 1e3


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type.name == "CUDA")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--shape", type=int, nargs="+", default=[8, 4096])
    a = ap.parse_args()
    f32 = torch.float32
    with torch.inference_mode():
        ts = [torch.randn(*a.shape, device="cuda", dtype=torch.bfloat16) for _ in range(a.n)]
        cases = {
            "foreach_norm ord1 dtype=f32": lambda: torch._foreach_norm(ts, 1, dtype=f32),
            "foreach_norm ord2 (no dtype)": lambda: torch._foreach_norm(ts, 2),
            "foreach_norm ord2 dtype=f32": lambda: torch._foreach_norm(ts, 2, dtype=f32),
            "foreach_clamp_max": lambda: torch._foreach_clamp_max(ts, 0.0),
            "stack 400 0-d": (lambda r=torch._foreach_norm(ts, 2): torch.stack(r)),
            "per-tensor sum+norm": lambda: [(torch.sum(t, dtype=f32), torch.linalg.vector_norm(t, dtype=f32)) for t in ts],
        }

        def step(defer):
            fps = StepFingerprints(defer_cuda=defer)
            for t in ts:
                fps.add([t], store=False)
            fps.finish_step(0)
            fps._pending.clear()

        cases["StepFingerprints deferred (add x n + finish)"] = lambda: step(True)
        cases["StepFingerprints immediate (add x n + finish)"] = lambda: step(False)
        print(f"# fp_probe n={a.n} shape={a.shape} bf16 torch={torch.__version__} {torch.cuda.get_device_name()}")
        for name, fn in cases.items():
            print(f"{name:48s} {timed(fn):10.1f} us/call  {kernels(fn):5d} kernels")


if __name__ == "__main__":
    main()
