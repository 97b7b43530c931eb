"""The store stage: rank files read (``reader``), loaded (``loader``) and merged (``merge``,
``merge_align``, ``merge_workers``) into one SQLite store (``tables``), and the store's points
read back (``points``)."""
