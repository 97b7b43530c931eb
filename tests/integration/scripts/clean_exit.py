"""The end of a gloo program, made safe from a race in PyTorch (2.13) and CPython (3.11) at exit.

After running a collective, a gloo worker thread (``pt_gloo_runloop``) wakes the caller and only
then drops its reference to the Work, and so to the collective's tensors. Where the program has
dropped those tensors in between, their Python objects were handed to the C++ tensors, and the
worker must take the GIL to release them. If the interpreter begins to finalize while the worker
waits for the GIL, CPython ends the thread with ``pthread_exit`` inside C++ destructors and the
process aborts: "terminate called without an active exception", SIGABRT, after the program's
work is done (backtrace: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil`` ->
``PyThread_exit_thread`` -> ``std::terminate``). Traced or not.

``dist.destroy_process_group()`` does not prevent it where a group outlives it: DTensor's and
DeviceMesh's caches keep every mesh's groups, and so their worker threads, alive until the
interpreter finalizes. A program can close the window itself: ``destroy_process_group`` here
destroys the groups, then sleeps (the GIL released, so a worker waiting for it gets it) until no
gloo worker thread of this process is running or runnable, at most ``timeout_s`` seconds.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

GLOO_WORKER = "pt_gloo_runloop"


def destroy_process_group(timeout_s: float = 5.0) -> None:
    """``dist.destroy_process_group()``, then wait for gloo's workers to finish what they hold."""
    dist.destroy_process_group()
    wait_for_idle_gloo_workers(timeout_s)


def wait_for_idle_gloo_workers(timeout_s: float = 5.0, poll_s: float = 0.01) -> bool:
    """Sleep until two polls in a row find no gloo worker thread running or runnable; False if
    ``timeout_s`` passed first. A worker waiting for the GIL gets it while this sleeps."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
        quiet = 0 if busy_gloo_workers() else quiet + 1
    return True


def busy_gloo_workers() -> list:
    """Thread ids of this process's gloo worker threads that are running or runnable (Linux)."""
    busy = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return busy
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        # "tid (comm) state ...": comm may hold spaces, so split at the last parenthesis.
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        state = stat[stat.rfind(")") + 2:][:1]
        if comm == GLOO_WORKER and state == "R":
            busy.append(int(tid))
    return busy
