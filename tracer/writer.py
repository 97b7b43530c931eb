"""RankWriter: the per-process, append-only, crash-safe rank file.

Records are appended to an in-memory list by the hooks (a list append: the cheapest thing a
hook can do; tracer/native_call.py adds a span's msgpack bytes to a run of them queued as one
item, tracer/native_spans.py) and written by a background thread at least once a second as one
framed chunk
(see ``tensor_trace.schema``); exit, SIGTERM and SIGINT flush what is left.

Idle flush. A server goes idle after its last request's last step, and may then be SIGKILLed
(SGLang kills its schedulers about a second after Ctrl-C): ``flush_when_idle`` (the tracer calls
it at every step end) asks the thread to write as soon as no record has been added for
``idle_flush_s``. The first step end of a burst sets an event; the thread then watches the queue
every ``idle_flush_s`` while records keep coming, and the step ends meanwhile find ``woken``
still set (an attribute read, no call). When the next step follows within that delay, nothing
is written until the periodic flush, so a busy process pays no write per step. So a process
killed with SIGKILL loses at most the records of the last ``idle_flush_s`` after a step (or of
the last second inside a long one).

Memory bound: at most ``max_buffered`` records wait in memory; past that the hook that adds the
record writes the chunk itself (disk, not drops: the trace is the point). Intern tables hold at
most ``max_interned`` entries; past that they are cleared and entries are re-emitted on next use
(a reader keeps the latest definition of an id).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import msgpack

from tensor_trace import schema
from tensor_trace.tracer import kinds

CHUNK_RECORDS = 256


def _array_head(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    return bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 0x10000 \
        else b"\xdd" + n.to_bytes(4, "big")


def pack_records(packer, records: list) -> bytes:
    """The msgpack array of ``records`` (one chunk's payload): tuples packed here, and bytes
    taken as they are, the packed tuple that tracer/native_call.py appends in their stead (so
    the payload is the same whichever appended a record)."""
    if bytes not in set(map(type, records)):
        return packer.pack(records)
    pack = packer.pack
    return _array_head(len(records)) + b"".join([r if r.__class__ is bytes else pack(r) for r in records])


def is_run(record) -> bool:
    """Whether a queued item is a run of packed spans (tracer/native_spans.py's ``SpanRun``: its
    ``len`` records, ``pack(i, j)`` their bytes) rather than one record (a tuple, or its bytes)."""
    return record.__class__ is not tuple and record.__class__ is not bytes


def chunk_payloads(packer, items: list) -> list:
    """The payloads of the chunks that ``items`` (queued records, some of them runs) make, each
    of at most CHUNK_RECORDS records, a run counted by its records and cut between two of them:
    the bytes that the same records queued one by one make (so the rank file is the same
    whichever path queued a span)."""
    if not any(map(is_run, items)):
        return [pack_records(packer, items[i:i + CHUNK_RECORDS]) for i in range(0, len(items), CHUNK_RECORDS)]
    payloads, parts, n = [], [], 0
    pack = packer.pack
    for r in items:
        if r.__class__ is tuple:
            parts.append(pack(r))
            n += 1
        elif r.__class__ is bytes:
            parts.append(r)
            n += 1
        else:
            i, size = 0, len(r)  # (read once: a run no longer queued takes no more records)
            while i < size:
                k = min(CHUNK_RECORDS - n, size - i)
                parts.append(r.pack(i, i + k))
                n += k
                i += k
                if n == CHUNK_RECORDS:
                    payloads.append(_array_head(n) + b"".join(parts))
                    parts, n = [], 0
            continue
        if n == CHUNK_RECORDS:
            payloads.append(_array_head(n) + b"".join(parts))
            parts, n = [], 0
    if n:
        payloads.append(_array_head(n) + b"".join(parts))
    return payloads


class RankWriter:
    """Append-only writer of one process's rank file."""

    def __init__(self, path: str, header: dict, *, flush_interval_s: float = 1.0,
                 idle_flush_s: float = 0.05, max_buffered: int = 200_000, max_interned: int = 500_000):
        self.path = path
        self.flush_interval_s = flush_interval_s
        self.idle_flush_s = idle_flush_s
        self.idle_flushes = 0  # chunks written because the process went idle (tests, stats)
        self.max_buffered = max_buffered
        self.max_interned = max_interned
        self.bytes_written = 0
        self.chunks_written = 0
        self.write_errors = 0
        # Records queued for the next chunk. The hooks append to it themselves (``add``
        # inlined, a Python call less per span: tracer/spans.py), some after Python code run
        # between reading ``pending`` and appending (a span's fingerprint): so ``flush`` takes
        # the records out of this one list and never replaces it, or a record appended to a
        # list it had already written would be lost.
        self.pending: list = []
        self.taken = 0  # records flush has taken out of pending so far
        self._lock = threading.Lock()  # one chunk written at a time, in order
        self._packer = msgpack.Packer(use_bin_type=True)
        self._strings: dict[str, int] = {}
        self.string_ids = self._strings  # read by tracer/collectives.py before asking string()
        self._metas: dict[tuple, int] = {}
        self.layout_ids: dict[tuple, int] = {}  # read by tracer/spans.py before asking layout()
        self._modules: dict[str, int] = {}
        self.generation = object()  # replaced whenever interned ids are forgotten
        self.on_forget: list = []  # called when interned ids are forgotten (caches of ids)
        self._closed = False
        self.listeners: list = []  # called with each flushed batch of records (live export)
        self._stop = threading.Event()
        self._wake = threading.Event()  # flush_when_idle, or close
        # Set by flush_when_idle, cleared by the thread once the queue stopped moving: while it
        # is set the thread watches the queue already, and a step end need not wake it (the
        # tracer reads it before calling flush_when_idle: tracer/steps.py).
        self.woken = False
        self._thread: threading.Thread | None = None
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        os.write(self._fd, schema.FILE_PREFIX)
        self.bytes_written += len(schema.FILE_PREFIX)
        self.pending.append((schema.HEADER, header))
        self.flush()
        self._start_thread()

    # -- interning: ids are per file; each definition is written before its first use --------
    def string(self, text: str) -> int:
        sid = self._strings.get(text)
        if sid is None:
            self._check_intern_bound()
            sid = len(self._strings)
            self._strings[text] = sid
            self.pending.append((schema.STRING, sid, text))
        return sid

    def module(self, path: str, class_name: str) -> int:
        """Intern a module path; its class is written with it the first time."""
        sid = self._modules.get(path)
        if sid is None:
            sid = self.string(path)
            self._modules[path] = sid
            self.pending.append((schema.MODULE, sid, self.string(class_name)))
        return sid

    def meta(self, shape, dtype, device, kind=None) -> int:
        """Intern tensor metadata; ``dtype`` and ``device`` may be torch objects or strings;
        ``kind`` a ``kinds.Meta`` (what kind of tensor, when not a plain one). A kind that the
        shape, dtype and device imply (``kinds.implied``) is written without being asked."""
        key = (shape, dtype, device) if kind is None else (shape, dtype, device, kind)
        mid = self._metas.get(key)
        if mid is None:
            self._check_intern_bound()
            mid = len(self._metas)
            self._metas[key] = mid
            dt = str(dtype).removeprefix("torch.")
            dev = str(device)
            if kind is None:
                kind = kinds.implied(shape, dt, dev)
            rec = (schema.META, mid, list(shape), self.string(dt), self.string(dev))
            self.pending.append(rec if kind is None else rec + (kinds.as_dict(kind),))
        return mid

    def layout(self, slots: tuple) -> int:
        """Intern a span's tensor layout: a tuple of (slot name, shape, dtype, device[, kind])
        (``kinds.slot``)."""
        lid = self.layout_ids.get(slots)
        if lid is None:
            self._check_intern_bound()
            lid = len(self.layout_ids)
            self.layout_ids[slots] = lid
            entries = [[self.string(e[0]), self.meta(*e[1:])] for e in slots]
            self.pending.append((schema.LAYOUT, lid, entries))
        return lid

    def _check_intern_bound(self) -> None:
        if len(self._strings) + len(self._metas) + len(self.layout_ids) >= self.max_interned:
            self._forget_ids()

    def _forget_ids(self) -> None:
        self._strings.clear()
        self._metas.clear()
        self.layout_ids.clear()
        self._modules.clear()
        self.generation = object()
        for forget in self.on_forget:
            forget()

    # -- records ------------------------------------------------------------------------------
    def add(self, record: tuple) -> None:
        """Queue one record (a tuple whose first item is its type)."""
        buf = self.pending
        buf.append(record)
        if len(buf) >= self.max_buffered:
            self.flush()

    def flush(self) -> None:
        """Write every queued record as one chunk. Safe from any thread; never raises."""
        with self._lock:
            pending = self.pending
            if self._closed or not pending:
                return
            buf = pending[:]
            del pending[:len(buf)]  # what was appended since stays for the next chunk
            self.taken += len(buf)
            start = self.bytes_written
            try:
                # Chunks of bounded size: damage to one costs at most CHUNK_RECORDS records.
                payloads = chunk_payloads(self._packer, buf)
                self._write_all(b"".join(map(schema.chunk, payloads)))
                self.chunks_written += len(payloads)
            except Exception as exc:  # a full disk must not take the traced program down
                self._write_failed(exc, start)
            if self.listeners and set(map(type, buf)) != {tuple}:  # (listeners take tuples)
                flat = []
                for r in buf:
                    if r.__class__ is tuple:
                        flat.append(r)
                    else:
                        flat.extend(msgpack.unpackb(b, use_list=False)
                                    for b in ((r,) if r.__class__ is bytes else r.records()))
                buf = flat
            for listener in self.listeners:
                try:
                    listener(buf)
                except Exception:
                    pass

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a short write (the disk filled up) is followed by the error it ran into
            n = os.write(self._fd, view)
            self.bytes_written += n
            view = view[n:]

    def _write_failed(self, exc: Exception, start: int) -> None:
        """These records are lost; the file keeps no torn chunk (the next write may succeed,
        once there is room), the definitions they carried are written again on next use, and
        the process is told once."""
        self.write_errors += 1
        self._forget_ids()
        try:
            os.ftruncate(self._fd, start)
            self.bytes_written = start
        except OSError:
            pass
        if self.write_errors == 1:
            try:
                sys.stderr.write(f"tensor-trace: cannot write {self.path} ({exc}): trace records "
                                 "are lost until it can (the program goes on)\n")
            except Exception:
                pass

    def queued_mark(self) -> tuple:
        """What moves with every record queued or taken: records taken so far, items queued,
        and the records in the last one where it is a run (tracer/native_spans.py: spans are
        added to the run at the queue's end, which the item count does not see)."""
        pending = self.pending
        n = len(pending)
        last = pending[n - 1] if n else None
        return self.taken, n, len(last) if n and is_run(last) else 0

    def flush_when_idle(self) -> None:
        """Ask the background thread to flush once no record has been added for
        ``idle_flush_s`` (e.g. a step has ended and no other begins). Never writes itself.
        While steps follow each other the thread is still watching the queue: a read."""
        if not self.woken:
            self.woken = True
            self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.flush()
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    os.close(self._fd)
                except OSError:
                    pass

    # -- background flushing ------------------------------------------------------------------
    def _start_thread(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tensor-trace-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Never raises (flush does not): an exception here would end flushing for good.
        stop, wake, clock = self._stop, self._wake, time.monotonic
        due = clock() + self.flush_interval_s
        while not stop.is_set():
            idle_chunk = False
            if wake.wait(max(0.0, due - clock())) and not stop.is_set():
                # A step ended: the queue is looked at every idle_flush_s while records keep
                # coming (the periodic flush takes them), with ``woken`` left set so that the
                # step ends meanwhile do not wake this thread again, until it stops moving.
                mark = self.queued_mark()
                while True:
                    if stop.wait(self.idle_flush_s):
                        return
                    moved = self.queued_mark()
                    if moved == mark:  # no flush, no record
                        break
                    mark = moved
                    if clock() >= due:
                        self.flush()
                        due = clock() + self.flush_interval_s
                        mark = self.queued_mark()
                # (in this order: a step that ends before ``woken`` is cleared, and so does not
                # set the event, has its records in the flush below; one that ends after sets it)
                wake.clear()
                self.woken = False
                idle_chunk = mark[1] > 0
            if stop.is_set():
                return
            self.flush()
            # Counted once written: whoever sees the count sees the chunk on disk.
            self.idle_flushes += idle_chunk
            due = clock() + self.flush_interval_s

    def before_fork(self) -> None:
        self._lock.acquire()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def abandon_after_fork(self) -> None:
        """In a forked child: the parent's file and thread are not ours; drop them unwritten."""
        self._lock = threading.Lock()
        self.pending = []
        self._closed = True
        try:
            os.close(self._fd)
        except OSError:
            pass
