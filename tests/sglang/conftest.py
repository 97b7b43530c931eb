"""tests/sglang is not a package: its server helper (server.py, standard library only, also run
as a script) is loaded here once, as the module ``tt_sglang_server``, for every test file of this
folder (``import tt_sglang_server as server``)."""

import importlib.util
import sys
from pathlib import Path

if "tt_sglang_server" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("tt_sglang_server", Path(__file__).with_name("server.py"))
    _server = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _server
    _spec.loader.exec_module(_server)
