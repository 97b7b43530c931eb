"""Start tracing from the environment that ``tensor-trace record`` prepared.

Called by the bootstrap ``sitecustomize`` right after ``import torch`` completes. Also arranges
that the rank file is completed on exit, SIGTERM, and in multiprocessing children (forked ones
leave through ``os._exit``, which skips ``atexit``; multiprocessing runs its own finalizers), and
that what is queued is written on SIGINT.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading


def start_from_env() -> None:
    from tensor_trace import tracer
    from tensor_trace.tracer.config import TraceConfig

    config = TraceConfig.from_env()
    if config is None:
        return
    tr = tracer.start(config)
    atexit.register(tracer.stop, "exit")
    _register_mp_finalizer(tr)
    try:
        # A multiprocessing child (fork, forkserver) leaves through os._exit, skipping atexit;
        # multiprocessing runs its own finalizers, but clears the parent's list after the fork:
        # register again from its after-fork hook, which runs after that clearing.
        from multiprocessing import util

        util.register_after_fork(tr, _register_mp_finalizer)
    except Exception:
        pass
    _install_signal_watch(tr)


def _register_mp_finalizer(tr) -> None:
    try:
        from multiprocessing import util

        util.Finalize(None, tr.stop, args=("exit",), exitpriority=-1000)
    except Exception:
        pass


def _install_signal_watch(tr) -> None:
    """Complete the rank file on SIGTERM, then die as SIGTERM would; write what is queued on
    SIGINT.

    SIGTERM: only where nobody else handles it. A Python handler runs only when the main thread
    executes Python again, and a rank blocked in a collective or a store wait may not for a
    long time: untraced, it would die at once. So, where the process has no wakeup fd yet, the
    signal also wakes a watcher thread (``signal.set_wakeup_fd``); if the handler has not run
    within ``SIGTERM_GRACE_S``, the watcher completes the file and restores the default action
    itself.

    SIGINT: the program's to handle, but Ctrl-C is often followed by a SIGKILL the traced
    process cannot see coming: a server's launcher kills its workers, and a worker started with
    ``PR_SET_PDEATHSIG`` (SGLang's schedulers) dies with its parent. The watcher writes the
    queued records at once, without waiting for an idle or periodic flush, so the last steps
    before Ctrl-C are on disk whatever follows."""
    if threading.current_thread() is not threading.main_thread():
        return
    handled = threading.Event()
    ours = False
    try:
        ours = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    except Exception:
        pass

    def die():
        _default_action_and_kill()

    def on_sigterm(signum, frame):
        handled.set()
        try:
            tr.stop("SIGTERM")
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            die()

    if ours:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        return
    if old != -1:  # someone (an event loop) owns the wakeup fd: leave it to them
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return

    def watch():
        while True:
            try:
                data = os.read(r, 512)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                flush_queued(tr)
            if ours and signal.SIGTERM in data and not handled.wait(SIGTERM_GRACE_S):
                try:
                    tr.stop("SIGTERM (main thread blocked)")
                finally:
                    die()

    threading.Thread(target=watch, name="tensor-trace-signals", daemon=True).start()


def flush_queued(tr) -> None:
    """Write the records queued so far (from any thread); the tracer goes on."""
    writer = tr.writer
    if writer is not None:
        try:
            writer.flush()  # never raises
        except Exception:
            pass


SIGTERM_GRACE_S = 0.5


def _default_action_and_kill() -> None:
    # signal.signal() works only in the main thread; libc's signal() works in any.
    try:
        import ctypes

        ctypes.CDLL(None).signal(signal.SIGTERM, 0)  # 0 = SIG_DFL
    except Exception:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except Exception:
            pass
    os.kill(os.getpid(), signal.SIGTERM)
