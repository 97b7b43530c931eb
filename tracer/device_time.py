"""Device time of collectives, from CUDA events, without synchronising the device.

A collective on CUDA tensors gets two timing events on the current stream of its tensors'
device: one recorded just before the call, one when the call is complete from the stream's
point of view (right after a blocking call returns, or when an async call's work is waited on:
both make the current stream wait for the communication stream, so the second event completes
when the communication has). ``elapsed_time`` between them is the collective's device time,
waiting for the slowest peer included, as NCCL's own timing would show it.

Events are only *queried*: ``collect`` turns the pairs whose end event has completed into
``COLL_DEVICE`` records and keeps the others for later (the next step end, or ``stop``, where it
may wait). Events are reused from a free list, so a step costs no event creation after the first.
The number of pairs waiting is bounded (``MAX_PENDING``); past it, new collectives go untimed
and are counted in ``dropped``.
"""

from __future__ import annotations

from tensor_trace import schema

MAX_PENDING = 1 << 16


def _cuda_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


def _current_stream(device):
    import torch

    return torch.cuda.current_stream(device)


class CollectiveDeviceTimes:
    """Start/end CUDA event pairs of collectives, resolved into ``COLL_DEVICE`` records."""

    def __init__(self, event_factory=None, stream_of=None):
        self._new_event = event_factory or _cuda_event
        self._stream_of = stream_of or _current_stream
        self._free: list = []
        self.pending: list = []  # (step, collective index, start event, end event); public: the
        # step end skips an empty collect() by reading it (tracer/steps.py)
        self.dropped = 0

    @staticmethod
    def device_of(tensors):
        """The CUDA device of the first CUDA tensor among ``tensors``, or None."""
        for t in tensors:
            if t.is_cuda:
                return t.device
        return None

    def _event(self):
        free = self._free
        return free.pop() if free else self._new_event()

    def start(self, device):
        """Record and return a start event on ``device``'s current stream (None: untimed)."""
        if len(self.pending) >= MAX_PENDING:
            self.dropped += 1
            return None
        ev = self._event()
        ev.record(self._stream_of(device))
        return (device, ev)

    def end(self, step: int, index: int, started) -> None:
        """Record the end event of collective ``index`` of ``step`` that ``start`` began."""
        device, start = started
        end = self._event()
        end.record(self._stream_of(device))
        self.pending.append((step, index, start, end))

    def discard(self, started) -> None:
        if started is not None:
            self._free.append(started[1])

    def collect(self, wait: bool = False) -> list:
        """``COLL_DEVICE`` records of the pairs whose end event has completed (all of them, after
        waiting, if ``wait``: only at stop, outside any step)."""
        if not self.pending:
            return []
        records, keep = [], []
        for item in self.pending:
            step, index, start, end = item
            if not end.query():
                if not wait:
                    keep.append(item)
                    continue
                end.synchronize()
            try:
                ns = int(start.elapsed_time(end) * 1e6)
            except RuntimeError:  # an event that never recorded (e.g. recorded under capture)
                ns = -1
            if ns >= 0:
                records.append((schema.COLL_DEVICE, step, index, ns))
            self._free.append(start)
            self._free.append(end)
        self.pending = keep
        return records

    def reset(self) -> None:
        """Forget pending pairs (a forked child: its parent's events are not its own)."""
        self.pending = []
        self._free = []
