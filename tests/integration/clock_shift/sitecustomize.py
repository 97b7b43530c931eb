"""Test-only: a traced process with a clock of its own.

On PYTHONPATH behind tensor-trace's bootstrap (which runs the sitecustomize it shadows), this
shifts the trace clock of the process whose ``RANK`` is R by N ns, for
``TEST_CLOCK_SHIFT_NS=R:N`` (R ``*``: every process, e.g. all of one "node", whatever
rank the rendezvous gives it): ``Tracer.absolute`` (raw monotonic time -> time written in the
trace) gains N, so every time the rank file holds, and its header's ``clock_offset_ns``
(``absolute(0)``), say that process's clock runs N ns ahead. It patches the class right after
tensor_trace.tracer.core is imported, before tracing starts, and imports nothing itself (an
early ``import torch`` here would run before the bootstrap watches for it).

``TEST_HOSTNAME=NAME`` also makes that process's tracer name its host NAME (in the rank file's
header and name), as if it ran on another machine: a second "node" on this one.
"""

import os
import sys


class _PatchAfterImport:
    name = "tensor_trace.tracer.core"

    def __init__(self, shift_ns, hostname):
        self.shift_ns = shift_ns
        self.hostname = hostname

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module
        shift_ns, hostname = self.shift_ns, self.hostname

        def exec_then_shift(module):
            exec_module(module)
            unshifted = module.Tracer.absolute
            module.Tracer.absolute = lambda tracer, raw_ns: unshifted(tracer, raw_ns) + shift_ns
            if hostname:
                module.socket = _HostNamed(hostname)

        spec.loader.exec_module = exec_then_shift
        return spec


class _HostNamed:
    """Stands for the socket module in tensor_trace.tracer.core, which asks it the host name only."""

    def __init__(self, hostname):
        self.hostname = hostname

    def gethostname(self):
        return self.hostname


def _install():
    rank, _, shift = os.environ.get("TEST_CLOCK_SHIFT_NS", "").partition(":")
    if shift and rank in ("*", os.environ.get("RANK")):
        sys.meta_path.insert(0, _PatchAfterImport(int(shift), os.environ.get("TEST_HOSTNAME")))


_install()
