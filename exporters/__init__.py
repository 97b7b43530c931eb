"""The after-the-run side of tensor-trace, in three stages: ``store`` (read rank files, merge
them into one SQLite store), ``analysis`` (placement, lineage, compare, check) and ``formats``
(Perfetto, OTLP, the record summary). ``pipeline`` opens a trace's analysed store; ``query``
answers the CLI's questions over it."""
