"""One kernel that fingerprints many tensors in place: (sum, l2 norm) of each, in fp32.

The deferred fingerprints of a step (and, under CUDA-graph capture, every fingerprint of the
captured step) used to be computed by stacking tensors of one shape into a copy and reducing the
copy: a copy of every activation, plus a few kernels per shape. Here a Triton kernel reads the
tensors where they are, through a table on the device, and adds each tensor's sum and sum of
squares into a ``[k, 2]`` fp32 buffer with atomics. No copy, one launch per dtype:

- eagerly (``sum_sumsq_table``, ``sum_l2``): a table of (address, element count, columns, row
  stride) per tensor and a grid of (tensor, 64 Ki-element chunk) programs as wide as the
  largest tensor; the host builds the table at every step, so it stays one entry per tensor;
- under capture (``sum_l2(capturing=True)``): a table of one entry per chunk, built once at
  capture time since every replay runs the same work: one program per chunk, each looping only
  over its own elements, tensors of every size and layout in one launch. Measured on the H200
  inside a graph (Llama-8B-shaped decode step, 416 MiB of bf16 at batch 64): 151 us, against
  251 us for per-size-class launches with stacked views and 118 us for one ``torch.sum`` over
  the same bytes (a probe since removed: ``git show f326002:bench/fp_kernel_probe.py``).

Eagerly the table is copied from pinned memory without waiting (the caching host allocator keeps
the pinned block until the copy has run). While a CUDA graph is captured, a host-to-device copy
cannot be captured safely, and it need not be: the kernel reads the table only when it runs,
i.e. at replay. So the table is filled once the capture has ended (``TableFill.run``), before the
first replay. It must not live in the graph's memory pool: a block the capture hands out may be
one an earlier kernel of the same graph writes at every replay (memory of a freed intermediate),
which would overwrite the table. So each capture gets a ``TableArena``, allocated before
``capture_begin`` from the ordinary pool, and tables are slices of it (``ARENA_ENTRIES`` int64,
128 KiB per captured graph, 4096 chunks; where a capture's work needs more, its chunks are made
longer until the table fits, and only past 4096 tensors are the rest stacked).

Tensors must be floating (fp32, fp16, bf16), contiguous or equally strided rows (``row_layout``),
below 2**31 elements, on one device; the caller falls back to stacking for anything else.
Triton is imported on first use; without it (or with
``TENSOR_TRACE_MULTI_TENSOR=0``) ``usable`` says no and nothing here is used. On a CPU the kernel
runs only under Triton's interpreter (``TRITON_INTERPRET=1`` and ``TENSOR_TRACE_MULTI_TENSOR=
interpret``), which is how CI tests it without a GPU.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

import torch

from tensor_trace.tracer.config import multi_tensor_from_env

# Measured on the H200 (392 MiB of bf16 activations in 385 tensors; torch.sum over the same bytes
# 107 us): CHUNK 32768 / BLOCK 2048 / 4 warps 271 us, 16384/2048/4 314 us, 32768/4096/8 193 us,
# 65536/4096/8 166 us, 131072/8192/16 229 us. Alignment hints on the addresses changed nothing.
CHUNK = 65536  # elements per program: a [8, 4096] activation is one program, [64, 14336] 14
BLOCK = 4096  # elements per loop iteration of a program
NUM_WARPS = 8

_state: dict = {}  # "kernel": the jitted function or None; "warm": devices warmed up


def _mode() -> str:
    return multi_tensor_from_env()  # TraceConfig.multi_tensor


def _kernel():
    if "kernel" in _state:
        return _state["kernel"]
    kernel = None
    if _mode() != "0":
        try:
            kernel = _build()
        except Exception:  # no Triton, or one too old for this kernel: the caller stacks
            kernel = None
    _state["kernel"] = kernel
    return kernel


def _build():
    import triton
    import triton.language as tl

    # ``first`` is not specialised on: one compiled kernel per dtype, whatever the launch (a
    # second specialisation would compile inside a capture).
    @triton.jit(do_not_specialize=["first"])
    def sum_sumsq(table, out, first, CHUNK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                  ROWS: tl.constexpr):
        # table holds (address, numel) pairs as int64 (ROWS: (address, numel, columns, row
        # stride), for a view whose rows are strided, e.g. q, k, v split from one projection):
        # program (t, c) reduces chunk c of tensor first + t.
        t = first + tl.program_id(0)
        if ROWS:
            n = tl.load(table + 4 * t + 1)
        else:
            n = tl.load(table + 2 * t + 1)
        start = tl.program_id(1).to(tl.int64) * CHUNK
        if start < n:
            if ROWS:
                base = tl.load(table + 4 * t).to(tl.pointer_type(DTYPE))
                cols = tl.load(table + 4 * t + 2).to(tl.int32)
                row_stride = tl.load(table + 4 * t + 3)
            else:
                base = tl.load(table + 2 * t).to(tl.pointer_type(DTYPE))
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(0, CHUNK, BLOCK):
                offs = start + i + tl.arange(0, BLOCK)
                if ROWS:  # 32-bit division (row_layout guarantees the range): 64-bit is slow
                    o32 = offs.to(tl.int32)
                    row = o32 // cols
                    ptrs = base + row.to(tl.int64) * row_stride + (o32 - row * cols)
                else:
                    ptrs = base + offs
                x = tl.load(ptrs, mask=offs < n, other=0.0).to(tl.float32)
                acc += x
                acc2 += x * x
            tl.atomic_add(out + 2 * t, tl.sum(acc, axis=0))
            tl.atomic_add(out + 2 * t + 1, tl.sum(acc2, axis=0))

    # Under capture: one program per chunk of a tensor, listed in a table built at capture time
    # (the replay's work is known then): one launch for a dtype's tensors of every size, no
    # program without work, and each program loops only over its own chunk. A table entry is
    # four int64: the address, start | end << 32 (element offsets in the tensor), out row |
    # columns << 32 (columns 0: contiguous; else rows of that many elements, ``row stride``
    # apart), and the row stride.
    # ``gate``: one int64 of the capture's arena (``ReplayGate``); 0 makes every program read
    # nothing, so a replay outside the fingerprint schedule costs the launch, not the reads.
    @triton.jit
    def sum_sumsq_chunks(table, out, gate, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        base = tl.load(table + 4 * p).to(tl.pointer_type(DTYPE))
        span = tl.load(table + 4 * p + 1)
        where = tl.load(table + 4 * p + 2)
        end64 = span >> 32
        start = (span - (end64 << 32)).to(tl.int32)
        on = tl.load(gate) != 0
        end = tl.where(on, end64.to(tl.int32), start)
        cols64 = where >> 32
        row = where - (cols64 << 32)
        cols = cols64.to(tl.int32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        # ``while``, not ``range`` with run-time bounds: Triton's interpreter (CI runs this
        # kernel there) cannot take a loaded value as a ``range`` bound under NumPy 2.
        i = start
        if cols == 0:
            while i < end:
                offs = i + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < end, other=0.0).to(tl.float32)
                acc += x
                acc2 += x * x
                i += BLOCK
        else:
            row_stride = tl.load(table + 4 * p + 3)
            while i < end:
                offs = i + tl.arange(0, BLOCK)
                r = offs // cols
                ptrs = base + r.to(tl.int64) * row_stride + (offs - r * cols)
                x = tl.load(ptrs, mask=offs < end, other=0.0).to(tl.float32)
                acc += x
                acc2 += x * x
                i += BLOCK
        tl.atomic_add(out + 2 * row, tl.sum(acc, axis=0), mask=on)
        tl.atomic_add(out + 2 * row + 1, tl.sum(acc2, axis=0), mask=on)

    _state["chunks"] = sum_sumsq_chunks
    _state["tl_dtypes"] = {torch.float32: tl.float32, torch.float16: tl.float16,
                           torch.bfloat16: tl.bfloat16}
    return sum_sumsq


def usable(t) -> bool:
    """Whether ``t``'s fingerprint can come from the multi-tensor kernel here: the kernel has
    been compiled and run for ``t``'s device (compiled now if no capture is under way)."""
    if t.is_cuda:
        ok = _state.get("warm", {}).get(t.device)
        if ok is None:
            if torch.cuda.is_current_stream_capturing():
                return False  # compiling inside a capture is not allowed: stack this time
            ok = warm_up(t.device)
        return ok
    return (_mode() == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"
            and _kernel() is not None)


def supported(t) -> bool:
    """Whether the kernel can read ``t`` where it is: contiguous, of a kernel dtype."""
    return t.dtype in DTYPES and t.is_contiguous()


_ROW_LAYOUTS: dict = {}  # (shape, strides) -> row_layout's answer: a step has a few of them


def row_layout(t):
    """``(columns, row stride)`` when ``t`` is a view of equal, strided rows of contiguous
    elements (q, k and v split from a fused projection along the last dimension), else None.
    The kernel reads such a view where it is, with ``layouts``."""
    key = (t.shape, t.stride())
    layout = _ROW_LAYOUTS.get(key, False)
    if layout is False:
        if len(_ROW_LAYOUTS) >= 4096:
            _ROW_LAYOUTS.clear()
        layout = _ROW_LAYOUTS[key] = _row_layout(*key)
    return layout


def _row_layout(sizes, strides):
    if len(strides) < 2 or strides[-1] != 1:
        return None
    row_stride = expect = None
    for d in range(len(sizes) - 2, -1, -1):  # outer dimensions, innermost first; size 1 is no step
        n = sizes[d]
        if n == 1:
            continue
        if row_stride is None:
            row_stride = strides[d]
        elif strides[d] != expect:
            return None  # rows not equally spaced
        expect = strides[d] * n
    if row_stride is None or sizes.numel() >= 1 << 31:
        return None  # one row (contiguous), or too large for the kernel's 32-bit offsets
    return (sizes[-1], row_stride)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


ARENA_ENTRIES = 16386  # int64: the gate, a pad, and 4096 chunks of a captured graph (four each)


class ReplayGate:
    """Whether the fingerprint kernels of one captured graph read their tensors at a replay.

    A captured kernel runs at every replay, while values are wanted only on the replays that
    the fingerprint schedule picks (tracer/graph_replay.py). The kernels read this one int64 on
    the device (entry 0 of the capture's arena) and read nothing when it is 0. ``set`` writes it
    in stream order before a replay, and only when it changes: a scheduled replay costs one
    small launch before and after it, the others none."""

    __slots__ = ("flag", "value")

    def __init__(self, flag):
        self.flag = flag  # a one-element int64 view of the arena
        self.value = 1

    def set(self, on: bool) -> None:
        value = 1 if on else 0
        if value != self.value:
            self.flag.fill_(value)
            self.value = value


class TableArena:
    """Device memory for the tables of one capture, allocated outside the graph's pool; its
    first entry is the capture's ``ReplayGate`` (on at first)."""

    __slots__ = ("buf", "used", "gate")

    def __init__(self, device, entries: int = ARENA_ENTRIES):
        # Zeros: where the kernel runs at once (Triton's interpreter on a CPU) it reads no tensor.
        # Not an inference tensor, though captured under inference_mode: the gate is written
        # before replays that may run outside it (an inference tensor cannot be, there).
        with torch.inference_mode(False):
            self.buf = torch.zeros(entries, dtype=torch.int64, device=device)
            self.buf[0] = 1
        self.gate = ReplayGate(self.buf[0:1])
        self.used = 2  # (16-byte aligned tables after the gate)

    def take(self, n: int):
        """A slice of ``n`` entries (16-byte aligned, so the kernel's specialisation matches the
        warm-up's), or None when the arena is full."""
        start = self.used
        if start + n > self.buf.numel():
            return None
        self.used = start + n + (n & 1)
        return self.buf[start:start + n]


def begin_capture(device) -> None:
    """A CUDA-graph capture on ``device`` is about to begin: give it an arena for its tables."""
    _state["arena"] = TableArena(device)


def end_capture() -> None:
    _state.pop("arena", None)


class TableFill:
    """A table allocated during a CUDA-graph capture, to be filled once the capture has ended.

    The copy is not waited for: ``run`` records an event after it, and ``before_replay`` makes
    the replaying stream wait for that event (a replay may come on another stream than the
    capture's, before the copy has run)."""

    __slots__ = ("table", "values", "done", "gate")

    def __init__(self, table, values, gate=None):
        self.table, self.values, self.done, self.gate = table, values, None, gate

    def run(self) -> None:
        host = torch.tensor(self.values, dtype=torch.int64)
        if not self.table.is_cuda:
            self.table.copy_(host)
            return
        self.table.copy_(host.pin_memory(), non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def before_replay(self) -> None:
        done = self.done
        if done is not None:
            torch.cuda.current_stream(self.table.device).wait_event(done)
            self.done = None


# Measured on the H200 inside a graph (f326002:bench/fp_kernel_probe.py, 416 MiB of bf16 in 481 tensors,
# chunk / block / warps): 65536/4096/8 147 us, 32768/4096/8 155, 131072/4096/8 154, 65536/2048/4
# 148, 65536/8192/8 256, 65536/4096/4 215, 262144/8192/8 230; a ``range`` loop instead of
# ``while`` 146. At 52 MiB (batch 8): 28 us, 32768 chunks 27.5, torch.sum 20.
CAPTURE_CHUNK = 65536  # elements per program of a captured launch (more where the arena is short)
MAX_NUMEL = 1 << 31  # the kernels' element offsets are 32-bit


def sum_l2(tensors, capturing: bool = False, layouts=None):
    """Launch the fingerprint kernel over ``tensors`` (one dtype, one device, ``supported``, or
    with ``layouts`` a ``row_layout`` each: None for a contiguous tensor, (columns, row stride)
    for a row-strided view; each below ``MAX_NUMEL`` elements).

    Returns ``(order, values, fill)``: ``values`` a ``[k, 2]`` fp32 tensor of (sum, l2 norm) on
    the tensors' device, computed in stream order, row ``i`` for ``tensors[order[i]]``; ``fill``
    a ``TableFill`` to run after the capture ends when ``capturing`` (its ``gate`` is the
    capture's ``ReplayGate``), else None. Returns None
    when capturing without room in the capture's arena (the caller stacks them). The tensors
    must stay alive until the kernel has run (eagerly: stream order covers it; captured: the
    graph's pool keeps them for replays).

    While capturing, the launch is one program per chunk (``capture_chunks``): the kernel runs
    at every replay, so its table is built once, here, to the work's exact size. Eagerly there is
    one launch as wide as the largest tensor (see below)."""
    kernel = _kernel()
    first = tensors[0]
    device = first.device
    out = None
    if capturing:
        arena = _state.get("arena")
        if arena is None or arena.buf.device != device:
            return None
        values = capture_chunks(tensors, layouts, arena.buf.numel() - arena.used)
        table = arena.take(len(values)) if values is not None else None
        if table is None:
            return None
        out = torch.zeros((len(tensors), 2), dtype=torch.float32, device=device)
        _state["chunks"][(len(values) // 4,)](table, out, arena.gate.flag, BLOCK=BLOCK,
                                              DTYPE=_state["tl_dtypes"][first.dtype],
                                              num_warps=NUM_WARPS)
        out[:, 1].sqrt_()
        return range(len(tensors)), out, TableFill(table, values, arena.gate)
    # Eagerly the host is the bottleneck (a Triton launch costs tens of microseconds from
    # Python) and deferred tensors are small (at most DEFER_MAX_NUMEL elements, 16 chunks):
    # one launch as wide as the largest, whose surplus programs return at once.
    values = []
    most = 1
    for i, t in enumerate(tensors):
        n = t.numel()
        values.append(t.data_ptr())
        values.append(n)
        if layouts is not None:
            values += layouts[i] or (n, n)  # a contiguous tensor: one row
        if n > most:
            most = n
    table = _device_table(values, device)
    out = torch.zeros((len(tensors), 2), dtype=torch.float32, device=device)
    kernel[(len(tensors), -(-most // CHUNK))](table, out, 0, CHUNK=CHUNK, BLOCK=BLOCK,
                                              DTYPE=_state["tl_dtypes"][first.dtype],
                                              ROWS=layouts is not None, num_warps=NUM_WARPS)
    out[:, 1].sqrt_()
    return range(len(tensors)), out, None


def capture_chunks(tensors, layouts, room: int):
    """The chunk table of a captured launch as a flat list of int64 (four per chunk, see
    ``sum_sumsq_chunks``), or None if it cannot fit in ``room`` entries. Chunks are
    ``CAPTURE_CHUNK`` elements, doubled until the table fits (fewer, longer programs)."""
    sizes = [t.numel() for t in tensors]
    chunk = CAPTURE_CHUNK
    while 4 * sum(-(-n // chunk) or 1 for n in sizes) > room:
        chunk *= 2
        if chunk > MAX_NUMEL:
            return None
    values: list = []
    for row, (t, n) in enumerate(zip(tensors, sizes)):
        layout = layouts[row] if layouts is not None else None
        if layout is None:
            where, stride = row, 0
        else:
            where, stride = row | (layout[0] << 32), layout[1]
        addr = t.data_ptr()
        start = 0
        while True:  # an empty tensor is one chunk with nothing to read
            end = min(n, start + chunk)
            values += (addr, start | (end << 32), where, stride)
            start = end
            if start >= n:
                break
    return values


def _device_table(values: list, device):
    """``values`` as an int64 tensor on ``device``; on a GPU copied from pinned memory without
    waiting (the caching host allocator keeps the pinned block until the copy has run).
    Packed with ``struct`` first: ``torch.tensor`` of a list of ints costs three to four times
    as much (129 against 43 microseconds for a step's 1824 values on a CPU here)."""
    n = len(values)
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    host = torch.empty(n, dtype=torch.int64, pin_memory=True)
    ctypes.memmove(host.data_ptr(), struct.pack(f"={n}q", *values), 8 * n)
    return host.to(device, non_blocking=True)


def sum_sumsq_table(table: list, count: int, most: int, dtype, device):
    """Eagerly launch the kernel over a table built by the caller: a flat list of (address,
    numel, columns, row stride) for ``count`` tensors of ``dtype`` on ``device`` (a contiguous
    tensor is one row: columns = row stride = numel), the largest of ``most`` elements. Returns
    a ``[count, 2]`` fp32 tensor of (sum, sum of squares), computed in stream order.

    The step's deferred tensors, whatever their layout, are one launch: the host is what a
    traced eager step waits for (a launch from Python costs tens of microseconds), while the
    device has time to spare for the row arithmetic and the programs of the small tensors that
    return at once."""
    # One buffer, one copy: the table, then the zeroed output (count int64 zeros are 2 * count
    # fp32 zeros, at an offset of 32 * count bytes: aligned as the warm-up's buffers were).
    n = len(table)
    if device.type == "cuda":
        host = torch.empty(n + count, dtype=torch.int64, pin_memory=True)
        ptr = host.data_ptr()
        ctypes.memmove(ptr, struct.pack(f"={n}q", *table), 8 * n)
        ctypes.memset(ptr + 8 * n, 0, 8 * count)
    else:
        host = torch.tensor(table + [0] * count, dtype=torch.int64)
    return sum_sumsq_buffer(host, count, most, dtype, device)


def sum_sumsq_buffer(host, count: int, most: int, dtype, device):
    """``sum_sumsq_table`` over a buffer already built: ``4 * count`` int64 table entries, then
    ``count`` int64 zeros for the output, on the host (pinned when ``device`` is a GPU; copied
    there without waiting) or on ``device``. Returns the ``[count, 2]`` fp32 output."""
    both = host.to(device, non_blocking=True) if host.device != device else host
    n = 4 * count
    dev_table = both[:n]
    out = both[n:].view(torch.float32).view(count, 2)
    _kernel()[(count, max(1, -(-most // CHUNK)))](dev_table, out, 0, CHUNK=CHUNK, BLOCK=BLOCK,
                                                  DTYPE=_state["tl_dtypes"][dtype], ROWS=True,
                                                  num_warps=NUM_WARPS)
    return out


def warm_up(device) -> bool:
    """Compile and run the kernel for every dtype on ``device``, outside any capture (compiling
    loads a module, which a capture must not see). Once per device per process; returns whether
    the kernel can be used there. After a failure (reported once on stderr) the caller stacks."""
    device = torch.device(device)
    warm = _state.setdefault("warm", {})
    if device in warm:
        return warm[device]
    warm[device] = False
    if _kernel() is None:
        return False
    # The self-check below reads its results back: one synchronisation per device per process,
    # ours. A program that runs under torch.cuda.set_sync_debug_mode("error") (to prove its own
    # steps never synchronise) would otherwise fail the check and lose the kernel for good.
    debug_mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        for dtype in DTYPES:
            flat = torch.arange(1, 5, dtype=dtype, device=device)
            sum_l2([flat])
            rows = torch.arange(1, 9, dtype=dtype, device=device).view(2, 4)[:, 1:3]
            sum_l2([rows], layouts=[row_layout(rows)])
            # the capture's kernel too, with a table 16-byte aligned as the arena's slices are
            arena = TableArena(device, 18)
            table_values = capture_chunks([flat, rows], [None, row_layout(rows)], 16)
            table = arena.take(len(table_values))
            table.copy_(torch.tensor(table_values, dtype=torch.int64))
            for on, expect in ((True, [[10.0, 30.0], [18.0, 98.0]]), (False, [[0.0, 0.0]] * 2)):
                arena.gate.set(on)
                got = torch.zeros((2, 2), dtype=torch.float32, device=device)
                _state["chunks"][(len(table_values) // 4,)](table, got, arena.gate.flag, BLOCK=BLOCK,
                                                            DTYPE=_state["tl_dtypes"][dtype],
                                                            num_warps=NUM_WARPS)
                if got.tolist() != expect:
                    raise RuntimeError(f"capture kernel self-check failed: {got.tolist()}")
    except Exception as exc:  # e.g. a Triton that cannot compile it: stack instead, say so once
        _state["kernel"] = None
        sys.stderr.write(f"tensor-trace: multi-tensor fingerprint kernel unavailable ({exc!r:.200}); "
                         "fingerprints are computed by stacking instead\n")
        return False
    finally:
        torch.cuda.set_sync_debug_mode(debug_mode)
    warm[device] = True
    return True
