"""``python -m tensor_trace``: the same as the ``tensor-trace`` command."""

from tensor_trace.cli import main

main(prog_name="tensor-trace")
