"""Check that recording does not break CUDA-graph capture (run on a GPU machine).

    python bench/cuda_graph_check.py TRACE_DIR PLAIN.json TRACED.json

TRACE_DIR is a `tensor-trace record` of `examples/tp_llama.py --device cuda --cuda-graph`;
PLAIN.json and TRACED.json are its `--out` files untraced and traced. Prints what the trace
holds (eager steps, the captured step, errors) and whether the outputs are bitwise equal.
Exit 1 if anything is off.
"""

import json
import sys

from tensor_trace import schema
from tensor_trace.exporters.reader import load_rank_file, rank_files


def main():
    trace_dir, plain, traced = sys.argv[1:4]
    a, b = json.load(open(plain)), json.load(open(traced))
    same = a["steps"] == b["steps"]
    (f,) = rank_files(trace_dir)
    rt = load_rank_file(f)
    ok = same and not rt.errors and rt.end is not None
    print(f"outputs bitwise equal traced vs untraced over {len(a['steps'])} steps: {same}")
    for step, st in sorted(rt.steps.items()):
        captured = sum(1 for s in st.spans if s.flags & schema.FLAG_CAPTURED)
        with_fp = sum(1 for s in st.spans for t in s.tensors if t.fp is not None)
        print(f"step {step}: attrs {st.attrs}, {len(st.spans)} spans, {captured} marked captured, "
              f"{with_fp} tensors fingerprinted")
        if st.attrs.get("captured"):
            ok &= captured == len(st.spans) and with_fp == 0
    captured_steps = [s for s, st in rt.steps.items() if st.attrs.get("captured")]
    ok &= len(captured_steps) == 1
    print(f"captured steps: {captured_steps} (replays are not traced: hooks do not fire in a replay)")
    print(f"tracer errors: {rt.errors}; end: {rt.end and rt.end['reason']}")
    print("CUDA-graph check:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
