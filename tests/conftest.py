import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for the whole run, fresh: tracer/native.py's extension is built
    at most once per run (tests/unit/test_native.py's cold build, first in the run; the tests
    after it load that build), whatever ~/.cache holds. A TORCH_EXTENSIONS_DIR the caller set
    is kept."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch-extensions"))
    return os.environ["TORCH_EXTENSIONS_DIR"]


@pytest.fixture
def fake_world():
    """torch.distributed's ``fake`` backend at rank 0 of 2 (collectives return at once, nothing
    else runs): for tests of what the tracer does around a collective. A module may define its
    own (another world size)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


# The test that builds tracer/native.py's extension cold, from a process that exits at once.
COLD_BUILD = "test_native.py::test_a_build_begun_by_a_process_that_exits_at_once_finishes_for_the_next"


def pytest_collection_modifyitems(config, items):
    """The native extension's cold build runs first: every traced process builds it by default
    (a traced test before it would start the build in this run's TORCH_EXTENSIONS_DIR, and that
    test would then need a folder and a build of its own); the tests after it load that build.
    The SGLang tests run last: `make test` builds their venv in the background while the
    others run (tests/sglang/conftest.py waits for it)."""
    sglang = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang") + os.sep
    # stable: order kept within each
    items.sort(key=lambda item: (not item.nodeid.endswith(COLD_BUILD), str(item.fspath).startswith(sglang)))
