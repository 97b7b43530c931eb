"""Writes tests/unit/data/format1/: a rank file of format 1 (written by tensor-trace at 2d8e23f,
before format 2) and what that version's reader resolved from it (expected.json).

    python make.py OUT   # with a format-1 tensor-trace; copy OUT/rank.ttr, OUT/expected.json here

Two steps of test_format.py's Net (two blocks with an all_reduce each, fake process group),
fingerprints deferred on the CPU (so its FINGERPRINTS records carry u32 indices and repeats
apart, as format 1 wrote them).
"""
import json
import os
import shutil
import sys

os.environ["TENSOR_TRACE_NATIVE"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from tensor_trace import schema, tracer  # noqa: E402
from tensor_trace.exporters.store.reader import load_rank_file, rank_files  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/unit
from test_format import Net  # noqa: E402  (the model of test_format's ``traced`` fixture)


def tensors(ts):
    return [[t.slot, t.shape, t.dtype, t.fp] for t in ts]


def main(out):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    net = Net()
    tracer.start(out_dir=out + "/trace", run_id="format1", fingerprint_mode="deferred")
    for _ in range(2):
        net(torch.randn(3, 4))
    tracer.stop()
    dist.destroy_process_group()
    (path,) = rank_files(out + "/trace")
    rt = load_rank_file(path)
    steps = {str(s): dict(root=st.root,
                          spans=[[sp.index, sp.parent, sp.path, sp.call, sp.t0, sp.dur, sp.flags, tensors(sp.tensors)]
                                 for sp in st.spans],
                          collectives=[[c.index, c.parent, c.op, c.reduce_op, c.seq, c.bytes, c.flags, tensors(c.tensors)]
                                       for c in st.collectives],
                          fingerprints={str(k): v for k, v in sorted(st.fingerprints.items())})
             for s, st in sorted(rt.steps.items())}
    expected = dict(format=schema.FORMAT_VERSION, identity=rt.identity, modules=rt.modules,
                    groups={str(k): v for k, v in rt.groups.items()},
                    params={k: tensors(v) for k, v in rt.params.items()}, steps=steps)
    shutil.copy(path, out + "/rank.ttr")
    with open(out + "/expected.json", "w") as f:
        json.dump(expected, f, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1])
