"""The ``tensor-trace`` command: a thin layer, one small function per command.

Errors derived from ``TensorTraceError`` become one line on stderr and the contract's exit code
(1: no answer in this trace, 2: bad usage or unreadable input); nothing else prints a traceback.
"""

from __future__ import annotations

import sys

import click

from tensor_trace.errors import TensorTraceError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TensorTraceError as exc:
            click.echo(f"tensor-trace: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=_Group)
@click.version_option(package_name="tensor-trace")
def main():
    """Distributed tensor tracing for tensor-parallel inference."""


def _register():
    from tensor_trace.cli import check, compare, contract, export, merge, query, record, report

    main.add_command(record.record)
    main.add_command(merge.merge)
    main.add_command(query.query)
    main.add_command(export.export)
    main.add_command(contract.contract)
    main.add_command(compare.compare)
    main.add_command(check.check)
    main.add_command(report.report)


_register()
