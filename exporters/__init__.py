"""The after-the-run side of tensor-trace: read rank files, merge, query, export."""
