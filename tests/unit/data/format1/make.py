"""Writes tests/unit/data/format1/: a rank file of format 1 (tensor-trace at 2d8e23f, the last
version that wrote format 1) and what that version's reader resolved from it (expected.json).

    python make.py OUT   # run with tensor-trace at 2d8e23f; copy OUT/rank.ttr, OUT/expected.json here
"""
import json, os, sys, shutil
os.environ["TENSOR_TRACE_NATIVE"] = "0"
import torch, torch.nn as nn, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from tensor_trace import tracer, schema
from tensor_trace.exporters.store.reader import load_rank_file, rank_files

class Block(nn.Module):
    def __init__(self):
        super().__init__(); self.up = nn.Linear(4, 8); self.down = nn.Linear(8, 4)
    def forward(self, x):
        y = self.down(torch.relu(self.up(x))); dist.all_reduce(y); return y

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.layers = nn.ModuleList([Block(), Block()])
    def forward(self, x):
        for layer in self.layers: x = layer(x)
        return x

out = sys.argv[1]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
torch.manual_seed(0)
net = Net()
tracer.start(out_dir=out + "/trace", run_id="format1", fingerprint_mode="deferred")
for _ in range(2):
    net(torch.randn(3, 4))
tracer.stop()
dist.destroy_process_group()
(f,) = rank_files(out + "/trace")
rt = load_rank_file(f)
def tensors(ts): return [[t.slot, t.shape, t.dtype, t.fp] for t in ts]
exp = dict(format=schema.FORMAT_VERSION, identity=rt.identity, modules=rt.modules, groups={str(k): v for k, v in rt.groups.items()},
           params={k: tensors(v) for k, v in rt.params.items()},
           steps={str(s): dict(root=st.root, spans=[[sp.index, sp.parent, sp.path, sp.call, sp.t0, sp.dur, sp.flags, tensors(sp.tensors)] for sp in st.spans],
                               collectives=[[c.index, c.parent, c.op, c.reduce_op, c.seq, c.bytes, c.flags, tensors(c.tensors)] for c in st.collectives],
                               fingerprints={str(k): v for k, v in sorted(st.fingerprints.items())})
                  for s, st in sorted(rt.steps.items())})
shutil.copy(f, out + "/rank.ttr")
json.dump(exp, open(out + "/expected.json", "w"), indent=None, sort_keys=True)
