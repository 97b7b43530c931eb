"""The rank-file format layer: the only code the writer (``tracer/``) and the readers
(``exporters/``, ``tracer/live_otlp.py``) share.

- ``tensor_trace.schema``: framing, record type numbers, flags and field orders (documented there).
- ``records``: each record kind's fields by name, and ``RecordResolver``, which turns the
  interned ids of a file (STRING, META, LAYOUT, MODULE, GROUP) into names, shapes and slots.
- ``fingerprints``: the FINGERPRINTS blob (packed float32 pairs, optional u32 indices).
- ``lineage_refs``: the input refs of LINEAGE and SLOT_SRC records.
- ``points``: point names (``MODULE[#CALL]:SLOT``): format, parse, glob match.
- ``otlp_spans``: the OpenTelemetry mapping (ids, names, attributes) of a module call or a
  collective, shared by ``tensor-trace export otlp`` and live streaming.

Nothing here imports torch or anything of ``tracer/`` or ``exporters/``.
"""
