"""The output stage: the merged trace in other formats (``perfetto``, ``otlp``) and the summary
``record`` prints (``summary``). ``base`` is the exporter interface they share."""
