"""The tracer must not change the lifetime of the program's objects: a model the program drops,
a process group it destroys. (Kept alive together, they make gloo ranks abort at exit: see
tt_helpers.record_distributed.)"""

from __future__ import annotations

import pytest

from tt_helpers import PYTHON, TINY_MODEL, record, run_cmd, write_script

SCRIPT = """
    import gc, sys, weakref
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            dist.all_reduce(y)
            return y

    m = M()
    with torch.no_grad():
        for _ in range(2):
            m(torch.ones(2, 4))
    ref = weakref.ref(c10d._get_default_group())
    dist.destroy_process_group()
    gc.collect()
    print("freed after destroy:", ref() is None)
    try:
        from tensor_trace import tracer
        tracer.stop()
    except ImportError:
        pass
    gc.collect()
    print("freed after tracer.stop:", ref() is None)
"""


def _run(tmp_path, traced):
    script = write_script(tmp_path, "pg_lifetime.py", SCRIPT)
    cmd = [PYTHON, script, tmp_path / ("store-traced" if traced else "store-plain")]
    if traced:
        res = record(tmp_path / "trace", cmd, timeout=60)
    else:
        res = run_cmd(cmd, timeout=60, check=True)
    return res.stdout.splitlines()


def test_untraced_program_frees_its_process_group(tmp_path):
    # the premise of the next test: without tracing the group is freed by destroy_process_group
    assert _run(tmp_path, traced=False) == ["freed after destroy: True", "freed after tracer.stop: True"]


def test_destroyed_process_group_is_released(tmp_path):
    lines = _run(tmp_path, traced=True)
    assert lines == ["freed after destroy: True", "freed after tracer.stop: True"]


MODEL_LIFETIME = TINY_MODEL + """
    import gc, weakref
    m = make_model()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(2, 16))
    ref = weakref.ref(m)
    del m
    gc.collect()
    print("model freed:", ref() is None)
"""


def _run_model(tmp_path, traced):
    script = write_script(tmp_path, "model_lifetime.py", MODEL_LIFETIME)
    if traced:
        res = record(tmp_path / "trace", [PYTHON, script], timeout=60)
    else:
        res = run_cmd([PYTHON, script], timeout=60, check=True)
    return res.stdout.splitlines()


def test_untraced_program_frees_its_model(tmp_path):
    assert _run_model(tmp_path, traced=False) == ["model freed: True"]


def test_dropped_model_is_released(tmp_path):
    assert _run_model(tmp_path, traced=True) == ["model freed: True"]
