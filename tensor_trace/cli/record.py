"""tensor-trace record [options] -- CMD [ARGS...]"""

from __future__ import annotations

import os
import sys
import uuid

import click

from tensor_trace.errors import BadInput


def launcher_run_id(cmd) -> str | None:
    """The launcher's run id: torchrun's ``--rdzv-id`` in CMD, else ``TORCHELASTIC_RUN_ID`` when
    the user exported it (torchrun sets it in its workers only); torchrun's default "none" is no id."""
    value = os.environ.get("TORCHELASTIC_RUN_ID", "")
    for i, arg in enumerate(cmd):
        name, eq, given = arg.partition("=")
        if name in ("--rdzv-id", "--rdzv_id"):
            value = given if eq else (cmd[i + 1] if i + 1 < len(cmd) else "")
            break
    value = value.strip()
    return value if value and value != "none" else None


@click.command(context_settings=dict(ignore_unknown_options=True, allow_interspersed_args=False))
@click.option("-o", "--out", "out_dir", default="tensor-trace-out", show_default=True,
              help="Folder for this run's rank files.")
@click.option("--module", "modules", multiple=True, help="Record only modules whose path matches this glob.")
@click.option("--exclude", "exclude", multiple=True, help="Do not record modules whose path matches this glob.")
@click.option("--steps", default=None, help="Record steps A:B of every process (0-based, B excluded).")
@click.option("--no-fingerprint", is_flag=True, help="Record shapes and dtypes only, no value fingerprints.")
@click.option("--no-lineage", is_flag=True,
              help="Do not watch the ops that combine tensors (cheaper; query lineage then has no answers).")
@click.option("--lineage-every", type=click.IntRange(min=1), default=128, show_default=True,
              help="Watch ops for lineage in the first 2 traced steps of each kind, then in every "
                   "Nth step of that kind (1: every step).")
@click.option("--fingerprint-every", type=click.IntRange(min=1), default=8, show_default=True,
              help="Take value fingerprints in the first 4 traced steps of each kind, then in every Nth "
                   "step of that kind (1: every step); spans are recorded on every step.")
@click.option("--intercept", type=click.Choice(["call", "hooks"]), default="call", show_default=True,
              help="How module calls are seen: 'call' wraps torch.nn.Module.__call__ while steps are "
                   "traced (cheapest); 'hooks' registers global forward pre/post hooks instead.")
@click.option("--otlp-endpoint", default=None, help="Also stream spans live to this OTLP endpoint.")
@click.option("--run-id", default=None,
              help="Run id shared by the nodes of one multi-node run (default: $TORCHELASTIC_RUN_ID when "
                   "exported, else a new one); a folder already holding this run is joined.")
@click.option("--replace", is_flag=True, help="Overwrite a run already recorded in the folder.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, required=True)
def record(out_dir, modules, exclude, steps, no_fingerprint, no_lineage, lineage_every, fingerprint_every, intercept,
           otlp_endpoint, run_id, replace, cmd):
    """Run CMD with every Python process it starts traced; print a summary; exit with CMD's code."""
    from tensor_trace.exporters.formats.summary import format_summary, summarize
    from tensor_trace.tracer.config import TraceConfig, parse_steps
    from tensor_trace.tracer.launch import prepare_out_dir, run_traced

    if otlp_endpoint:
        try:
            import opentelemetry.exporter.otlp  # noqa: F401
        except ImportError:
            raise BadInput("--otlp-endpoint needs the otlp extra: pip install 'tensor-trace[otlp]'")
    try:
        window = parse_steps(steps)
    except ValueError as exc:
        raise BadInput(str(exc))
    shared_id = run_id or launcher_run_id(cmd)
    config = TraceConfig(out_dir=out_dir, run_id=shared_id or uuid.uuid4().hex[:16], modules=list(modules),
                         exclude=list(exclude), steps=window, fingerprint=not no_fingerprint,
                         lineage=not no_lineage, lineage_every=lineage_every,
                         fingerprint_every=fingerprint_every,
                         intercept=intercept, otlp_endpoint=otlp_endpoint)
    prepare_out_dir(out_dir, replace, run_id=shared_id)
    code = run_traced(list(cmd), config)
    click.echo(format_summary(summarize(out_dir)), err=True)
    sys.exit(code)
