"""Two outermost modules in one process (SGLang's EAGLE-3 target and draft, a held-out run not
written here): each root's parameters were fingerprinted as step PARAMS_STEP numbered from 0, so
the draft's took the target's indices and the reader kept one value per index: target weights
read the draft's values (a k_norm weight read as the draft's sharded qkv_proj), and verdicts and
check called correct tensors divergent."""

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.exporters.store.reader import load_rank_file, rank_files


def _model(seed, *sizes):
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])))


def test_each_roots_parameters_keep_their_own_fingerprints(tmp_path):
    target, draft = _model(1, 4, 6, 4), _model(2, 4, 3, 4)
    tracer.start(out_dir=str(tmp_path), fingerprint_every=1)
    try:
        with torch.no_grad():
            for _ in range(2):
                target(torch.ones(2, 4))
                draft(torch.ones(2, 4))
    finally:
        tracer.stop()
    (path,) = rank_files(str(tmp_path))
    rt = load_rank_file(path)
    got = {(mod, t.slot): t.fp for mod, ts in rt.params.items() for t in ts}
    want = {}
    for prefix, model in (("", target), ("Sequential2", draft)):
        for name, p in model.named_parameters():
            mod, leaf = name.rsplit(".", 1)
            want[(f"{prefix}.{mod}" if prefix else mod, leaf)] = p.detach().double()
    assert set(want) <= set(got), (sorted(got), sorted(want))
    for key, p in want.items():
        s, q = got[key]
        assert abs(s - float(p.sum())) < 1e-4 and abs(q - float((p * p).sum())) < 1e-4, key
