"""The output stage: the merged trace in other formats (``perfetto``, ``otlp``, the HTML
``report``) and the summary ``record`` prints (``summary``). ``base`` is the exporter interface
the streaming ones share."""
