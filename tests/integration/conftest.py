"""Integration tests: real `tensor-trace record` runs of real programs (see tt_helpers.py)."""

import shutil
from pathlib import Path

import pytest

from tt_helpers import TORCHRUN, TP_LLAMA, record

_HERE = Path(__file__).resolve().parent

# The example's options most modules read a trace of: 2 layers, 3 steps (tp_llama's defaults
# otherwise). A module that needs another run records its own.
EXAMPLE_OPTIONS = ("--layers", "2", "--steps", "3")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


class ExampleTraces:
    """``torchrun --nproc-per-node TP examples/tp_llama.py OPTIONS`` (EXAMPLE_OPTIONS unless
    given), traced once per test session, world size and options, on first request. Modules
    get copies of the rank files: a merge or an export writes into the folder it reads, and a
    test may damage its copy."""

    def __init__(self, root: Path):
        self.root = root
        self.recorded: dict = {}

    def original(self, tp: int, options=EXAMPLE_OPTIONS, record_options=()) -> Path:
        """The recording itself (read only: take a copy to merge, export or damage it);
        ``record_options`` are ``tensor-trace record``'s own."""
        key = (tp, tuple(options), tuple(record_options))
        if key not in self.recorded:
            out = self.root / f"run{len(self.recorded)}-tp{tp}"
            record(out, [TORCHRUN, "--standalone", "--nproc-per-node", str(tp), TP_LLAMA, *options],
                   *record_options, timeout=240)
            self.recorded[key] = out
        return self.recorded[key]

    def copy(self, tp: int, dest, options=EXAMPLE_OPTIONS, record_options=()) -> str:
        """A fresh trace folder at ``dest`` with the recording's run.json and rank files, written
        now (not copying their times: a store is stale when a rank file is newer, as after a
        recording, and test_merge_query.py moves a store's time back a minute to make it so)."""
        shutil.copytree(self.original(tp, options, record_options), dest, ignore=shutil.ignore_patterns("merged.sqlite*"),
                        copy_function=shutil.copyfile)
        return str(dest)


@pytest.fixture(scope="session")
def example_traces(tmp_path_factory) -> ExampleTraces:
    return ExampleTraces(tmp_path_factory.mktemp("example-traces"))
