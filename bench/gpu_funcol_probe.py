"""Functional collectives traced on CUDA tensors in one process (PyTorch's fake backend, world 4):
deferred fingerprints of AsyncCollectiveTensor module outputs, waits reached from the tracer's
own reads, the TP-API model's DTensor redistributions. Prints what it checked; exits 1 on a
failed check. One device-tool call from the repo root:
    source bench/gpu_env.sh funcol.txt; python3 $REPO/bench/gpu_funcol_probe.py /tmp/probe
(Without CUDA it runs the same on the CPU: a dry run of the script.)"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration", "scripts"))
import funcol_tp  # noqa: E402

FAILED = []
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a dry run of the script)


def check(what, ok):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILED.append(what)


class Issue(nn.Module):
    def forward(self, x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)


class Use(nn.Module):
    def forward(self, y):
        return y.view(-1) + 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.issue, self.use = Issue(), Use()

    def forward(self, x):
        pending = [self.issue(x) for _ in range(2)]
        # The last is never waited by the program: the tracer must not wait it either
        # (tracer/kinds.py), so it closes unwaited, without output values.
        return [self.use(y) for y in pending], self.issue(x)


def traced(out, fn, steps=2):
    tracer.start(out_dir=out)
    try:
        with torch.no_grad():
            for _ in range(steps):
                fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
    finally:
        tracer.stop()
    (path,) = rank_files(out)
    return load_rank_file(path)


def main(out):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    x = torch.randn(64, 48, device=DEV)
    net = Net()
    rt = traced(os.path.join(out, "net"), lambda: net(x))
    step = rt.steps[1]
    spans = {s.index: s for s in step.spans}
    cs = step.collectives
    check(f"3 all_reduces issued by 'issue' ({[spans[c.parent].path for c in cs]})",
          len(cs) == 3 and all(spans[c.parent].path == "issue" for c in cs))
    check(f"the two waited are waited, the last unwaited ({[bool(c.flags & 16) for c in cs]})",
          [bool(c.flags & 16) for c in cs] == [False, False, True])
    want = (x * 2).sum().item()
    outs = [c.tensors[-1].fp for c in cs]
    check(f"waited outputs' fingerprints are the values, the unwaited one has none ({outs}, want sum {want:.4f})",
          all(o is not None and abs(o[0] - want) <= 1e-3 * max(1.0, abs(want)) for o in outs[:2]) and outs[2] is None)
    issue_outs = [s.tensors[-1].fp for s in step.spans if s.path == "issue"]
    # Whether one AsyncCollectiveTensor was waited is known only as "c10d's registry of unwaited
    # results is empty" (tracer/kinds.py waited()); with the third still unwaited at the step's
    # end no module output can be proven waited, so none is read: no values, never wrong ones.
    check(f"module outputs (AsyncCollectiveTensors) not read while a result is unwaited ({issue_outs})",
          issue_outs == [None, None, None])
    check(f"tracer errors: {rt.errors[:3]}", not rt.errors)
    if DEV == "cuda":
        check(f"device times of the waited collectives recorded: {[c.device_ns for c in cs]}",
              all(c.device_ns is not None for c in cs[:2]))

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEV, (4,))
    torch.manual_seed(0)
    sizes = dict(funcol_tp.SIZES, heads=8, kv_heads=8, hidden=96, seq=12, vocab=96, dim=48)
    for plan in ("plain", "sp"):
        model = funcol_tp.parallelize(funcol_tp.transformer(**sizes).to(DEV).eval(), mesh, plan)
        tokens = torch.randint(0, sizes["vocab"], (2, 12), device=DEV)
        rt = traced(os.path.join(out, plan), lambda: model(tokens))
        step = rt.steps[1]
        cs = step.collectives
        spans = {s.index: s for s in step.spans}
        ops = sorted({c.op for c in cs})
        check(f"{plan}: {len(cs)} collectives {ops}, none unwaited, all with output fingerprint indices",
              cs and all(not c.flags & 16 and c.fp_refs[-1] >= 0 for c in cs))
        check(f"{plan}: issuing modules {sorted({spans[c.parent].path for c in cs})}",
              {spans[c.parent].path for c in cs} >= {"tok_embeddings", "layers.0.attention.wo"})
        if plan == "sp":
            check(f"sp: dims {[c.attrs.get('scatter_dim', c.attrs.get('gather_dim')) for c in cs]}",
                  all(c.attrs and ("scatter_dim" in c.attrs or "gather_dim" in c.attrs) for c in cs))
        check(f"{plan}: tracer errors: {rt.errors[:3]}", not rt.errors)
    dist.destroy_process_group()
    print("FAILED:", FAILED if FAILED else "none")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/funcol-probe"))
