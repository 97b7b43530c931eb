"""Aligned text tables for people; --json prints the data itself."""

from __future__ import annotations

import json

import click


def echo_json(data) -> None:
    click.echo(json.dumps(data, indent=1, default=str))


def echo_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            click.echo("  ".join("-" * w for w in widths))


def fmt_shapes(shapes: dict) -> str:
    vals = list(shapes.values())
    if vals and all(v == vals[0] for v in vals):
        return f"{vals[0]} x{len(vals)}" if len(vals) > 1 else str(vals[0])
    return " ".join(f"r{k}:{v}" for k, v in shapes.items())
