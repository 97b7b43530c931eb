"""The Python API for notebooks and scripts: the CLI's answers as plain Python objects.

    import tensor_trace
    t = tensor_trace.open("tensor-trace-out")
    t.points("model.layers.0.*")              # list of dicts, the keys of `query placement --json`
    t.reduction("model.embed_tokens")["verdict"]
    t.compare("other-run")["first_divergence"]

Lists come back as ``Rows`` (a list of dicts) and single answers as ``Answer`` (a dict); both
serialise to exactly what ``--json`` prints, and have ``to_pandas()`` where pandas is
installed (pandas is never required). ``with tensor_trace.trace(out_dir=...):`` traces a block
of this process's own code. The ``tensor-trace`` commands are thin wrappers over this module.
"""

from __future__ import annotations

import contextlib
import os

from tensor_trace.errors import BadInput

DEFAULT_DIR = "tensor-trace-out"


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError("to_pandas() needs pandas (pip install pandas); the data itself is plain "
                          "Python lists and dicts") from None
    return pandas


def _frame(records: list):
    return _pandas().DataFrame.from_records(records)


class Rows(list):
    """A list of answer objects (dicts with the CLI's JSON keys)."""

    def to_pandas(self):
        """A pandas DataFrame with one row per object."""
        return _frame(list(self))


class SqlRows(Rows):
    """``sql`` results: one dict per row, plus the result's ``columns`` and row ``values`` as
    SQLite gave them (a column name may repeat; the dicts then keep the last)."""

    def __init__(self, columns: list, values: list):
        super().__init__(dict(zip(columns, row)) for row in values)
        self.columns = columns
        self.values = values

    def to_pandas(self):
        return _pandas().DataFrame(self.values, columns=self.columns)


class Answer(dict):
    """One answer object (a dict with the CLI's JSON keys). ``to_pandas()`` frames its list of
    items (``points`` of a comparison, ``sources`` of a lineage), else the object as one row."""

    def __init__(self, data: dict, items: str | None = None):
        super().__init__(data)
        self.items_key = items

    def to_pandas(self):
        if self.items_key:
            return _frame(list(self[self.items_key]))
        return _frame([dict(self)])


class Trace:
    """A recorded trace folder. The merged store is built on first use when missing or older
    than the rank files (as the CLI does), and opened read-only."""

    def __init__(self, trace_dir: str = DEFAULT_DIR):
        self.dir = str(trace_dir)
        self._con = None

    def __repr__(self) -> str:
        return f"Trace({self.dir!r})"

    @property
    def con(self):
        """The read-only sqlite3 connection to the merged store (merged on demand)."""
        if self._con is None:
            from tensor_trace.exporters.pipeline import open_store

            self._con = open_store(self.dir)
        return self._con

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Questions: the contract's `query` commands.
    def points(self, pattern: str | None = None, step: int | None = None) -> Rows:
        """Placement and reduction of the points matching ``pattern`` (a glob over module paths,
        or over point names when it has ':'; default all outputs), as ``query placement``."""
        from tensor_trace.exporters import query

        return Rows(query.placement(self.con, pattern, step))

    def reduction(self, point: str) -> Answer:
        """Is ``point`` pre- or post-reduction, and which collective completes or produced it."""
        from tensor_trace.exporters import query

        return Answer(query.reduction(self.con, point))

    def shapes(self, point: str) -> Rows:
        """Shapes and dtypes of ``point`` (a glob allowed) on every rank."""
        from tensor_trace.exporters import query

        return Rows(query.shapes(self.con, point))

    def lineage(self, point: str) -> Answer:
        """What ``point``'s tensor was built from: ``sources`` in order and the op."""
        from tensor_trace.exporters.analysis import lineage

        return Answer(lineage.lineage(self.con, point), items="sources")

    def collectives(self, pattern: str | None = None) -> Rows:
        """Collectives per issuing module (``pattern``: a glob over module paths)."""
        from tensor_trace.exporters import query

        return Rows(query.collectives(self.con, pattern))

    def steps(self, where: dict | None = None) -> Rows:
        """Traced steps per process with their attrs; ``where`` keeps those whose attrs match."""
        from tensor_trace.exporters import query

        return Rows(query.steps(self.con, where or {}))

    def sql(self, query: str) -> SqlRows:
        """Run SQL over the merged store (docs/store-schema.md)."""
        from tensor_trace.exporters import query as q

        res = q.sql(self.con, query)
        return SqlRows(res["columns"], res["rows"])

    def diff(self, other) -> Answer:
        """Points added, removed or changed in ``other`` (a Trace or a folder)."""
        from tensor_trace.exporters import query

        con = self.con
        return Answer(query.diff(con, _as_trace(other).con))

    # Checks.
    def check(self) -> Rows:
        """Findings this trace shows by itself (``{kind, point, collective, detail, evidence}``)."""
        from tensor_trace.exporters.analysis.check import check

        return Rows(check(self.con))

    def compare(self, other, pattern: str | None = None, steps=None) -> Answer:
        """Compare with ``other`` (a Trace or a folder) point by point: ``first_divergence``,
        ``points``, ``tolerance``. ``steps``: pairs as ``compare --steps`` takes them."""
        from tensor_trace import progress
        from tensor_trace.exporters.analysis.compare import compare

        con = self.con
        other_con = _as_trace(other).con
        with progress.task("comparing"):
            return Answer(compare(con, other_con, pattern, steps), items="points")

    def contract(self, point: str) -> dict:
        """A capture contract for ``point`` (what ``contract save`` writes)."""
        from tensor_trace.exporters.analysis import lineage

        return lineage.make_contract(lineage.lineage(self.con, point))

    def check_contract(self, contract: dict) -> Rows:
        """Mismatches between this trace and a contract (empty when it holds)."""
        from tensor_trace.exporters.analysis import lineage

        return Rows(lineage.compare(contract, lineage.lineage(self.con, contract["point"])))

    # Outputs.
    def merge(self) -> dict:
        """Merge the rank files into the store now (queries do it on demand); the merge report."""
        from tensor_trace.exporters.pipeline import merge_ranks

        self.close()
        return merge_ranks(self.dir)

    def export_perfetto(self, out: str | None = None) -> dict:
        """Write the Chrome trace-event timeline of all ranks; ``{path, events, bytes}``."""
        from tensor_trace.exporters.formats.perfetto import export_perfetto

        return export_perfetto(self.dir, out)

    def export_otlp(self, endpoint: str, protocol: str = "grpc") -> dict:
        """Send the trace to an OTLP endpoint; ``{endpoint, protocol, spans}``."""
        from tensor_trace.exporters.formats.otlp import export_otlp

        return export_otlp(self.dir, endpoint, protocol)

    def report(self, out: str | None = None, compare_with=None) -> dict:
        """Write the one-file HTML report (default ``DIR/report.html``); with ``compare_with``
        (a Trace or a folder) its comparison too. Returns ``{path, bytes, ...}``."""
        from tensor_trace.exporters.formats.report import write_report

        other = _as_trace(compare_with) if compare_with is not None else None
        return write_report(self, out or os.path.join(self.dir, "report.html"), other)


def _as_trace(other) -> Trace:
    return other if isinstance(other, Trace) else Trace(other)


def open(trace_dir: str = DEFAULT_DIR) -> Trace:  # noqa: A001 - the API's name, as the issue asks
    """Open a recorded trace folder (``tensor-trace record -o DIR``)."""
    if not isinstance(trace_dir, (str, os.PathLike)):
        raise BadInput(f"open() takes a trace folder, not {type(trace_dir).__name__}")
    if not os.path.isdir(trace_dir):
        raise BadInput(f"{trace_dir}: no such trace folder")
    return Trace(os.fspath(trace_dir))


class Recording:
    """What ``with tensor_trace.trace(...)`` yields: the folder, and ``open()`` once it ended."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def open(self) -> Trace:
        return open(self.out_dir)


@contextlib.contextmanager
def trace(out_dir: str = DEFAULT_DIR, replace: bool = False, **options):
    """Trace this process's module calls inside the block (each outermost module call is a
    step); ``options`` are ``TraceConfig`` fields (``modules``, ``steps``, ``fingerprint``...).
    A folder that already holds a run is refused, as ``tensor-trace record`` refuses it, unless
    ``replace=True`` (which removes that run first). The rank file is complete when the block ends::

        with tensor_trace.trace(out_dir="my-trace") as rec:
            model(x)
        rec.open().points()
    """
    from tensor_trace import tracer

    if tracer.current() is not None:
        raise BadInput("a tracer is already running in this process (tensor-trace record, or another "
                       "tensor_trace.trace block)")
    from tensor_trace.tracer.launch import prepare_out_dir

    prepare_out_dir(str(out_dir), replace, how="pass replace=True to overwrite it, or another out_dir")
    tracer.start(out_dir=str(out_dir), **options)
    try:
        yield Recording(str(out_dir))
    finally:
        tracer.stop()
