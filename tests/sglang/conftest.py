"""tests/sglang is not a package: its server helper (server.py, standard library only, also run
as a script) is loaded here once, as the module ``tt_sglang_server``, for every test file of this
folder (``import tt_sglang_server as server``).

`make test` builds the SGLang venv (setup.sh) in the background while the other tests run and
names a status file in ``TT_SGLANG_SETUP_STATUS`` (setup.sh's exit code, once it is done): these
tests wait for it first."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

SETUP_WAIT_S = 1800

if "tt_sglang_server" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("tt_sglang_server", Path(__file__).with_name("server.py"))
    _server = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _server
    _spec.loader.exec_module(_server)


@pytest.fixture(scope="session", autouse=True)
def sglang_venv_built():
    """Wait for the background setup.sh of `make test`, and fail with its log if it failed;
    skip where no SGLang venv was built (a plain pytest run without setup.sh). Decided here,
    when the first SGLang test runs, not at collection: the venv may still be being built then."""
    status = os.environ.get("TT_SGLANG_SETUP_STATUS")
    if status:
        _wait_for_setup(status)
    ready, why = sys.modules["tt_sglang_server"].venv_ready()
    if not ready:
        pytest.skip(f"no SGLang venv: {why}")


def _wait_for_setup(status: str) -> None:
    deadline = time.monotonic() + SETUP_WAIT_S
    while not os.path.exists(status) or not open(status).read().strip():
        if time.monotonic() > deadline:
            pytest.fail(f"tests/sglang/setup.sh did not finish within {SETUP_WAIT_S} s")
        time.sleep(1)
    code = open(status).read().strip()
    if code != "0":
        log = os.environ.get("TT_SGLANG_SETUP_LOG")
        tail = open(log).read()[-4000:] if log and os.path.exists(log) else ""
        pytest.fail(f"tests/sglang/setup.sh failed (exit {code}):\n{tail}", pytrace=False)
