"""Building tracer/native.py's extension from its source: its folder, the toolchain it needs,
the build lock, the detached build (``python -m tensor_trace.tracer.native FOLDER STAMP``, which
calls ``main`` here) and the import of a finished build. tracer/native.py says when a process
builds and what it does meanwhile; this file never imports it (the source comes as an argument).

A folder holds one build per Python and torch version; ``tensor_trace.stamp`` (a hash of the
source and torch's version) is written once the build is finished, ``tensor_trace.failed``
(the same hash) when it failed (its log, ``tensor_trace.build.log``, says why)."""

from __future__ import annotations

import os
import sys


def build_path() -> str:
    """The PATH a build runs with: the running Python's folder first, so that a virtual
    environment's ninja (the dev extra's) is found when that environment is not activated."""
    return os.pathsep.join(p for p in (os.path.dirname(sys.executable), os.environ.get("PATH")) if p)


def missing_toolchain() -> str | None:
    """What this machine lacks to build the extension (torch's compiler, ``$CXX`` or ``c++``;
    ninja; Python's headers), or None. Read from PATH and the file system, no process run."""
    import shutil
    import sysconfig

    path = build_path()
    cxx = (os.environ.get("CXX") or "c++").split()[0]
    if not shutil.which(cxx, path=path):
        return f"a C++ compiler ({cxx})"
    if not shutil.which("ninja", path=path):
        return "ninja"
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"Python's headers ({include}/Python.h)"
    return None


def build_directory() -> str:
    """Where the extension is built and cached: ``$TORCH_EXTENSIONS_DIR`` (else torch's default
    root), one folder per Python and torch version."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_root()
    tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    return os.path.join(root, f"tensor_trace_native_py{sys.version_info[0]}{sys.version_info[1]}_{tag}")


def _default_root() -> str:
    # torch.utils.cpp_extension.get_default_build_root's folder, without importing that module
    # (it imports setuptools: 0.1 s of CPU in every traced process that only loads the build)
    try:
        from torch._appdirs import user_cache_dir
    except ImportError:  # (another torch: its own function, at that cost)
        from torch.utils.cpp_extension import get_default_build_root

        return get_default_build_root()
    return os.path.realpath(user_cache_dir(appname="torch_extensions"))


def stamp_of(source: str) -> str:
    """The stamp of a build of ``source`` with this torch."""
    import hashlib

    import torch

    return hashlib.sha256(f"{torch.__version__}\n{source}".encode()).hexdigest()


def _holds(folder: str, name: str, stamp: str) -> bool:
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read().strip() == stamp
    except OSError:
        return False


def built(folder: str, stamp: str) -> bool:
    """Whether ``folder`` holds a finished build of this stamp (written after it)."""
    return _holds(folder, "tensor_trace.stamp", stamp)


def failed(folder: str, stamp: str) -> bool:
    """Whether a build of this stamp failed in ``folder`` (its log is there)."""
    return _holds(folder, "tensor_trace.failed", stamp)


class _BuildLock:
    """The build flock of ``folder``. torch's own build lock is a file that a process killed
    mid-build leaves behind, after which every later build waits for it forever. So builds of
    this extension also take an flock, which the OS releases when its holder dies: holding it,
    no build of ours is running, and a torch lock file found then is such a leftover."""

    def __init__(self, folder: str):
        self.folder = folder

    def __enter__(self):
        import fcntl

        os.makedirs(self.folder, exist_ok=True)
        self.file = open(os.path.join(self.folder, "tensor_trace.flock"), "a+")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        try:
            os.remove(os.path.join(self.folder, "lock"))
        except FileNotFoundError:
            pass
        return self

    def __exit__(self, *exc):
        self.file.close()  # (releases the flock)


def _compile(folder: str, source: str):
    """Build and import the extension, the build lock held; stamps the folder."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(name="tensor_trace_native", cpp_sources=[source],
                         extra_cflags=["-O2"], build_directory=folder, verbose=False)
    with open(os.path.join(folder, "tensor_trace.stamp"), "w") as f:
        f.write(stamp_of(source))
    try:
        os.remove(os.path.join(folder, "tensor_trace.failed"))
    except FileNotFoundError:
        pass
    return module


def load(folder: str, source: str):
    """Import the extension, building it first if needed, under the build lock."""
    with _BuildLock(folder):
        if built(folder, stamp_of(source)):
            return _import_built(folder)
        return _compile(folder, source)


def _import_built(folder: str):
    """The finished build's module, imported from its file (what load_inline does once ninja
    has found nothing to do, without running ninja: a traced process need not find it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tensor_trace_native",
                                                  os.path.join(folder, "tensor_trace_native.so"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The detached build's exit status: 0 built (or found built), 1 failed here (the log says why),
# 2 a failed build of this source found marked, under auto (reported by the process that ran it).
CHILD_BUILT, CHILD_FAILED, CHILD_MARKED = 0, 1, 2


def build_detached(folder: str, stamp: str) -> int:
    """Compile in a child process of its own session, and wait for it: a traced process that
    exits first (a short run, a test) does not take the compiler down with it, so the build
    finishes and the next process loads it at once. The child is not traced: the bootstrap
    folder of ``tensor-trace record`` is left off its PYTHONPATH. Its exit status."""
    import subprocess

    bootstrap = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
    env = dict(os.environ, PATH=build_path())
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.abspath(p) != bootstrap]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    with open(os.path.join(folder, "tensor_trace.build.log"), "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "tensor_trace.tracer.native", folder, stamp],
                                 env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True, close_fds=True)
    return child.wait(timeout=1800)


def main(folder: str, stamp: str, source: str) -> int:
    """The detached build (``python -m tensor_trace.tracer.native FOLDER STAMP``). Whoever holds
    the build lock first compiles; the ranks that waited for it find the stamp and leave without
    importing torch."""
    try:
        os.nice(19)  # the traced run that started it is what the cores are for
    except OSError:
        pass
    with _BuildLock(folder):
        if built(folder, stamp):
            return CHILD_BUILT
        if failed(folder, stamp) and _auto_mode():
            return CHILD_MARKED
        try:
            _compile(folder, source)
        except Exception:
            with open(os.path.join(folder, "tensor_trace.failed"), "w") as f:
                f.write(stamp)
            raise  # (its traceback goes to the log)
    return CHILD_BUILT


def _auto_mode() -> bool:
    from tensor_trace.tracer.config import native_from_env

    return native_from_env() in ("auto", "")
