"""What following module parameters costs on lineage steps (tracer/lineage_params.py and the ops of
tracer/lineage_attrs.py), switched step by step in one traced process:

- ``param-ops``: lineage as recorded now (the parameter ops watched, parameters known);
- ``old-ops``: the watcher without them (those ops removed from ``_TRACKED``, the parameters
  forgotten): what a lineage step cost before;
- ``no-lineage``: a step that records no lineage (the mode is not entered: nothing of the above
  runs there, whatever the variant).

Workloads: transformers' MixtralForCausalLM (its experts index their stacked weights inside one
call: what the parameter ops exist for) and LlamaForCausalLM (attention's views, transposes and
slices of recorded tensors, now watched too), random weights, one process, no TP, CPU float32,
one thread, fingerprints off (so that only the watcher differs). Every round runs one step of each
variant in a shuffled order (bench/common.py ``shuffled_rounds``); times are the step's thread CPU
time. Prints the median of per-round ratios.

    OMP_NUM_THREADS=1 .venv/bin/python bench/lineage_params_ab.py [--rounds 40] [--hidden 256] [--seq 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

VARIANTS = ("param-ops", "old-ops", "no-lineage")


def _model(name, hidden, layers):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=8, num_experts_per_tok=2)).eval()
    return LlamaForCausalLM(LlamaConfig(**sizes)).eval()


def run_workload(name, args) -> dict:
    import torch

    from tensor_trace import tracer
    from tensor_trace.tracer import lineage, lineage_attrs

    model = _model(name, args.hidden, args.layers)
    ids = torch.randint(0, 1024, (1, args.seq), generator=torch.Generator().manual_seed(1))
    t = tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-lpab-"), fingerprint=False, lineage_every=1)
    new_ops = lineage_attrs.tracked()
    rec = t.lineage

    def set_variant(v):
        t.config = dataclasses.replace(t.config, lineage_every=1 if v != "no-lineage" else 1 << 40)
        if v == "old-ops":
            for f in new_ops:
                lineage._TRACKED.pop(f, None)
            for k in rec.params:
                rec.producers.pop(k, None)
        else:
            lineage._TRACKED.update(new_ops)
            rec.producers.update(rec.params)

    def step(v):
        set_variant(v)
        with torch.no_grad():
            t0 = time.thread_time_ns()
            model(input_ids=ids, use_cache=False)
            return time.thread_time_ns() - t0

    try:
        for v in VARIANTS * 2:  # warm-up (and the root's adoption, the first lineage steps)
            step(v)
        times = common.shuffled_rounds(step, VARIANTS, args.rounds)
    finally:
        set_variant("param-ops")
        tracer.stop()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--workloads", nargs="+", default=["mixtral", "llama"])
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    h = common.header(sys.argv)
    print(common.header_line("lineage_params_ab", h))
    for name in args.workloads:
        times = run_workload(name, args)
        med = {v: common.median(times[v]) / 1e6 for v in VARIANTS}
        print(f"{name} (hidden {args.hidden}, {args.layers} layers, seq {args.seq}, {args.rounds} rounds): "
              + ", ".join(f"{v} {med[v]:.2f} ms" for v in VARIANTS)
              + f"; param-ops/old-ops x{common.paired_ratio(times, 'param-ops', 'old-ops'):.3f}"
              + f", old-ops/no-lineage x{common.paired_ratio(times, 'old-ops', 'no-lineage'):.3f}"
              + f", param-ops/no-lineage x{common.paired_ratio(times, 'param-ops', 'no-lineage'):.3f}")
    print(f"# load after: {common.load_summary().split('load average:')[-1].strip()}")


if __name__ == "__main__":
    main()
