import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for the whole run, fresh: tracer/native.py's C++ table is built
    at most once per run (tests/unit/test_native.py's cold build; the tests after it load that
    build), whatever ~/.cache holds. A TORCH_EXTENSIONS_DIR the caller set is kept."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch-extensions"))
    return os.environ["TORCH_EXTENSIONS_DIR"]


def pytest_collection_modifyitems(config, items):
    """The SGLang tests run last: `make test` builds their venv in the background while the
    others run (tests/sglang/conftest.py waits for it)."""
    sglang = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang") + os.sep
    items.sort(key=lambda item: str(item.fspath).startswith(sglang))  # stable: order kept within each
