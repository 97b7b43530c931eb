"""The rank-file format: framing, record types, flags (the format layer's constants).

With ``tensor_trace.format`` (each record kind's fields by name, the id resolver, fingerprint
blobs, lineage refs, point names) it is the only code the writer (tracer) and the readers
(exporters, live OTLP) share.

A rank file is ``MAGIC`` + a little-endian u32 ``FORMAT_VERSION``, then a sequence of chunks.
Each chunk is a sync marker + u32 stored length + u32 CRC-32 of the stored bytes + the stored
bytes: a msgpack array of records, as is after ``SYNC``, zlib-compressed after ``SYNC_ZLIB``
(format 2: a 256-record chunk of spans and fingerprints shrinks to 0.6-0.7 of its msgpack, for
zlib's level-1 time in the writer's thread, which lets go of the GIL meanwhile; bench/trace_bytes.py
prints both). A writer appends whole chunks at each flush, so a process killed mid-write leaves
at most one torn chunk at the tail; a reader that meets a bad chunk scans forward for the next
sync marker and reports what it skipped.

Format 1 is format 2 without compressed chunks, and with FINGERPRINTS records in any order of
indices: readers of format 2 read it as it is (``READABLE_VERSIONS``).

Every record is a msgpack array whose first element is its type. Strings that repeat (module
paths, dtypes, slot names, group names) are interned once per file with ``STRING`` records and
referred to by id; tensor metadata (shape, dtype, device) is interned with ``META``; the set of
tensors of one span (slot name + meta per tensor) is interned as a ``LAYOUT``. Ids are per file.

Times are host ``time.monotonic_ns()`` values; ``HEADER`` carries one wall-clock anchor
(``wall_ns`` taken next to ``mono_ns``) so ranks on one host share a clock and other hosts can
be aligned later. Within a step, span times are offsets in ns from the step's start.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

MAGIC = b"\x89TTRACE\n"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FILE_PREFIX = MAGIC + struct.pack("<I", FORMAT_VERSION)
SYNC = b"\xf7TTc"  # the chunk's payload is stored as is
SYNC_ZLIB = b"\xf7TTz"  # the chunk's payload is stored zlib-compressed
SYNC_STEM = SYNC[:3]  # what both markers start with (a reader resynchronises on it)
CHUNK_HEAD = struct.Struct("<4sII")  # sync, stored length, crc32 of the stored bytes
MAX_CHUNK_BYTES = 64 << 20  # a reader refuses longer claims (stored or inflated): corruption
ZLIB_LEVEL = 1  # levels 6 and 9 save under 1 % more on traces, at several times the time
RANK_FILE_SUFFIX = ".ttr"

# Record types. The comment after each gives the array layout after the type.
HEADER = 0  # dict: run_id, pid, ppid, host, argv, mono_ns, wall_ns, config, format
IDENTITY = 1  # dict: rank, world_size, local_rank, tp_rank, tp_size, tp_ranks, device, ... (latest wins)
STRING = 2  # id, text
META = 3  # id, shape (list of int), dtype string id, device string id[, kind (dict)]: kind only
#           for a tensor that is not a plain dense one (docs/store-schema.md, "Tensor kinds"):
#           a DTensor's shape is its local tensor's and kind holds its global shape and
#           placements; other kinds say which values the fingerprint is of, or that it has none
LAYOUT = 4  # id, [[slot string id, meta id], ...]
MODULE = 5  # path string id, class string id
GROUP = 6  # group id, name, ranks (list of global ranks), backend, c10d group name
STEP_BEGIN = 7  # step, root path string id, mono_ns, attrs (dict)[, fingerprinted (bool): whether
#                 the step takes fingerprints (TraceConfig.fingerprint_every); absent: as the header's
#                 config says for every step, from a tracer that fingerprinted every step or none]
STEP_END = 8  # step, mono_ns, n_spans, n_collectives[, attrs (dict): attributes learnt during the
#               step (Tracer.add_step_attrs), over STEP_BEGIN's; absent when none]
SPAN = 9  # step, index, parent index (-1 = none), path id, call, t0, dur, layout id,
#            fp_pre, fp_post, n_pre, flags (format/records.py names every kind's fields)
COLLECTIVE = 10  # step, index, parent span index, op id, reduce-op id (-1 none), group id, seq,
#                  t0, dur, layout id, fp_pre, fp_post, n_pre, flags, bytes[, attrs]
# attrs (optional, a dict, only when non-empty): what the Python layer that issued the op knew
# and the op does not (tracer/functional.py): "gather_dim" / "scatter_dim" (int, or a list per
# input for the coalesced functions), "gather_dim" and "shard_dim" of DTensor's
# shard_dim_alltoall, "redistribute" ({"from": [...], "to": [...], "async_op": bool}: a DTensor
# redistribution's placements as str() gives them, e.g. "P(sum)", "S(1)", "R").
# Fingerprint indices: the first n_pre tensors of the layout (seen when the call began) have
# fingerprints fp_pre, fp_pre+1, ...; the others (seen when it ended) fp_post, fp_post+1, ...
# -1 means no fingerprints.
FINGERPRINTS = 11  # step, first index, packed little-endian float32 pairs (sum, sum of squares),
#                    packed u32 indices or None when they run first, first+1, ...; NaN = none
#                    (encode and decode: tensor_trace/format/fingerprints.py). Format 2 writers
#                    write a step's values in index order, repeats included: one record of
#                    consecutive indices (indices None) where every index has a value
ERROR = 12  # mono_ns, where, message, count so far
END = 13  # dict: reason, stats (spans, collectives, steps, bytes, errors, dropped)
# 14: no longer written (it was SKIPPED_STEPS)
PARAMS = 15  # module path id, [[name string id, meta id, fingerprint index(, kind)], ...]; the
#              fingerprints are in FINGERPRINTS records of step PARAMS_STEP; an entry's optional
#              kind (a dict, as META's) stands instead of its META's (the tracer writes META's)
PARAMS_STEP = -1
CAPTURE_INFO = 16  # path string id of a named capture point ("capture:NAME"), info (dict)
MODULE_ATTRS = 17  # module path string id, dict: what a framework says the layer does
#                    (class, gather_output, reduce_results, input_is_parallel, group, ...)
COLL_DEVICE = 18  # step, collective index (-1: the step's CUDA-graph replay), device time in ns
#                   (CUDA events around the call)
REPLAY = 19  # step, captured step, span base, collective base, fingerprint base (-1 none), t0, dur:
#              a CUDA-graph replay of the captured step; the step holds that step's spans and
#              collectives again, their indices shifted by the bases, with the replay's
#              fingerprints (written as FINGERPRINTS of this step from the fingerprint base)

LINEAGE = 20  # step, node, op string id, attrs (dict or None), input refs, output shape: an op
#               that built a tensor out of others (tracer/lineage.py says what a ref is)
SLOT_SRC = 21  # step, span index, slot position in its layout, ref: that slot's tensor is a node's result
#               (or, ref [0, ...], a module output that a cat, stack or write laid out, passed on as is)
WIDE_FINGERPRINTS = 22  # step, [index, sum, sum of squares, index, ...] (msgpack floats, 64-bit):
#                         fingerprints finite in float64 but past float32's range (an attention
#                         mask of torch.finfo(float32).min: its sum of squares is about 1e78), whose
#                         FINGERPRINTS value is +-inf; a reader takes these instead (tensor_trace/format/fingerprints.py)
NONFINITE_FINGERPRINTS = 23  # step, [index, sum, sum of squares, +inf count, -inf count, NaN count, index, ...]:
#                              a CPU tensor whose FINGERPRINTS value is not finite (an attention mask
#                              of -inf), fingerprinted again over its finite values, with how many of
#                              each non-finite value it holds (tensor_trace/format/fingerprints.py)

# SPAN / COLLECTIVE flags.
FLAG_CAPTURED = 1  # recorded while a CUDA graph was being captured: structure only
FLAG_ASYNC = 2  # async collective: the span ends when its work was waited on
FLAG_ERROR = 4  # the module or collective raised
# 8: no longer written (it was FLAG_NO_FP: a span without fingerprints has fp_pre = fp_post = -1)
FLAG_UNWAITED = 16  # async collective whose work was never waited on before the step ended
FLAG_REPLAYED = 32  # (merged store only) a CUDA-graph replay's copy of a captured span or collective:
#                     values are the replay's, times are the capture's (a replay is one launch)

# Slot names of a span's tensors: "input.0", "input.NAME", "output", "output.0", "output.0.key".
# Collective slots: "input.0" ..., "output.0" ... (point names: tensor_trace/format/points.py)


def chunk(payload: bytes, compress: bool = True) -> bytes:
    """Frame one msgpack payload as a chunk, zlib-compressed unless ``compress`` is false or
    that would not make it shorter. (zlib lets go of the GIL while it compresses: the writer
    thread's compression does not hold up the traced program's own threads.)"""
    if compress:
        packed = zlib.compress(payload, ZLIB_LEVEL)
        if len(packed) < len(payload):
            return CHUNK_HEAD.pack(SYNC_ZLIB, len(packed), zlib.crc32(packed)) + packed
    return CHUNK_HEAD.pack(SYNC, len(payload), zlib.crc32(payload)) + payload


_INFLATE = None  # (decompressobj, its error class): inflate_with(), chosen at the first chunk read


def inflate_with(name: str | None = None) -> tuple:
    """What ``chunk_payload`` inflates with: ``"isal"`` (ISA-L's zlib, from the optional ``isal``
    package: the same bytes in about half of zlib's time, and inflating is ~13 % of a merge's
    loading), ``"zlib"``, or None: isal where it is installed, else zlib. Imported here, not
    with this module: the tracer imports it and never inflates."""
    if name in (None, "isal"):
        try:
            from isal import isal_zlib

            return isal_zlib.decompressobj, isal_zlib.error
        except ImportError:
            if name == "isal":
                raise
    return zlib.decompressobj, zlib.error


def chunk_payload(sync: bytes, stored) -> bytes:
    """The msgpack payload of a chunk whose CRC matched: ``stored`` as is after ``SYNC``,
    inflated after ``SYNC_ZLIB`` (at most ``MAX_CHUNK_BYTES``). Raises ValueError for bytes
    that do not inflate, or inflate past the bound."""
    global _INFLATE
    if sync == SYNC:
        return stored
    if _INFLATE is None:
        _INFLATE = inflate_with()
    decompressobj, error = _INFLATE
    try:
        inflater = decompressobj()
        payload = inflater.decompress(stored, MAX_CHUNK_BYTES)
    except error as exc:
        raise ValueError(f"a compressed chunk does not inflate: {exc}") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise ValueError("a compressed chunk inflates past its bound or is cut short")
    return payload


# Environment variables through which `tensor-trace record` configures every child process.
ENV_DIR = "TENSOR_TRACE_DIR"
ENV_RUN_ID = "TENSOR_TRACE_RUN_ID"
ENV_CONFIG = "TENSOR_TRACE_CONFIG"  # JSON: modules, exclude, steps, fingerprint, otlp_endpoint, ...
ENV_BOOTSTRAP = "TENSOR_TRACE_BOOTSTRAP"  # the bootstrap folder, so it can find the next sitecustomize


def read_run_id(trace_dir: str, warn=None) -> str | None:
    """The run id in ``trace_dir/run.json`` (written by ``record`` next to the rank files), or
    None; ``warn`` (if given) is told when the file is there but unreadable."""
    path = os.path.join(trace_dir, "run.json")
    try:
        with open(path) as f:
            return json.load(f).get("run_id")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        if warn is not None:
            warn(f"{path} is unreadable; taking the run id from the rank files")
        return None
