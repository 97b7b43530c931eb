"""The truth corpus: tensor-parallel programs parallelised by libraries nobody here wrote, each
point's verdict taken from the PLAN, compared with what tensor-trace says.

Programs (tests/integration/scripts/):
- ``titan``: a torchtitan-style Llama on PyTorch's TP API (tp_api_llama.py), plans ``plain``,
  ``gathered``, ``sp`` (sequence parallel) and ``dtensor`` (DTensors flow between modules);
- ``hf``: transformers' LlamaForCausalLM loaded with ``tp_plan="auto"`` (tp_hf_llama.py);
- ``hf-mixtral``: transformers' MixtralForCausalLM likewise (tp_hf_mixtral.py), at TP 2 only: its
  experts index their stacked, sharded weights inside one call, where only the lineage of the
  parameters tells what ``act_fn`` receives;
- ``hf-olmo2``: transformers' Olmo2ForCausalLM likewise (tp_hf_olmo2.py), at TP 2: gathered
  column-parallel outputs (``colwise_gather_output``) normed whole, a row-parallel ``o_proj`` that
  slices a replicated input (``rowwise_split_input``), norms after the sublayers;
- ``hf-qwen3``: transformers' Qwen3ForCausalLM likewise (tp_hf_qwen3.py), at TP 2: per-head norms
  (``replicated_with_grad_allreduce``) of a 4-D view of each rank's column-parallel q and k;
- ``hf-phi3``: transformers' Phi3ForCausalLM likewise (tp_hf_phi3.py), at TP 2: packed
  ``qkv_proj`` and ``gate_up_proj`` gathered (the activation chunks a whole tensor), dropout
  modules between the sublayers and their residual adds;
the others at TP 2 and 3 on CPU gloo. The truth (truth_corpus.py) is derived from the plan the program
applies and the ParallelStyles' semantics; an untraced run of the same program measures every
point's local shape (point_probe.py), which checks the truth itself before tensor-trace is judged.

Each (program, plan, tp) is recorded once (module-scoped fixture, 2 steps); a failing comparison
prints every mismatch, one line each: point, what differs, expected, got, evidence.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tensor_trace.cli import main as cli_main
from tt_helpers import TORCHRUN, base_env, record, run_cmd

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
sys.path[:0] = [str(SCRIPTS)]

import tp_api_llama  # noqa: E402  (the programs' own plan and sizes feed the truth)
import tp_hf_llama  # noqa: E402
import tp_hf_mixtral  # noqa: E402
import tp_hf_olmo2  # noqa: E402
import tp_hf_phi3  # noqa: E402
import tp_hf_qwen3  # noqa: E402
import truth_corpus as truth  # noqa: E402

STEPS = 2
TIMEOUT = 240
SCRIPT = {"titan": SCRIPTS / "tp_api_llama.py", "hf": SCRIPTS / "tp_hf_llama.py",
          "hf-mixtral": SCRIPTS / "tp_hf_mixtral.py", "hf-olmo2": SCRIPTS / "tp_hf_olmo2.py",
          "hf-qwen3": SCRIPTS / "tp_hf_qwen3.py", "hf-phi3": SCRIPTS / "tp_hf_phi3.py"}
CASES = [("titan", plan, tp) for plan in tp_api_llama.PLANS for tp in (2, 3)] + \
        [("hf", "auto", tp) for tp in (2, 3)] + [("hf-mixtral", "auto", 2), ("hf-olmo2", "auto", 2),
                                                    ("hf-qwen3", "auto", 2), ("hf-phi3", "auto", 2)]


def _torchrun(program, tp, *args):
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(tp), SCRIPT[program], *args]


def _cli(*args):
    r = CliRunner().invoke(cli_main, [str(a) for a in args])
    assert r.exit_code == 0, f"tensor-trace {' '.join(map(str, args))}: exit {r.exit_code}\n{r.output[-3000:]}"
    return json.loads(r.stdout)


@dataclass
class Case:
    program: str
    plan: str
    tp: int
    walk: truth.Walk
    got: dict  # point -> query placement --json object
    ref: Path  # untraced run: rank<R>.pt, shapes<R>.json
    traced: Path  # traced run's rank<R>.pt
    trace: Path
    summary: str

    @property
    def name(self):
        return f"{self.program}/{self.plan}/tp{self.tp}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``get(program, tp)``: the folder of an untraced reference run with the probe (one run of
    every titan plan in one process), made once."""
    made = {}
    root = tmp_path_factory.mktemp("truth_refs")

    def get(program, tp):
        key = (program, tp)
        if key not in made:
            out = root / f"{program}{tp}"
            args = ["--plan", "all"] if program == "titan" else ["--ckpt", root / f"{program}-ckpt",
                                                                 "--plan-out", out / "plan.json"]
            res = run_cmd(_torchrun(program, tp, *args, "--steps", STEPS, "--dump", out, "--probe"),
                          timeout=TIMEOUT, env=base_env())
            assert res.returncode == 0, f"untraced {program} tp{tp}: exit {res.returncode}\n{res.stderr[-3000:]}"
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-tp{c[2]}")
def case(request, references, tmp_path_factory):
    program, plan, tp = request.param
    ref_root = references(program, tp)
    ref = ref_root / plan if program == "titan" else ref_root
    work = tmp_path_factory.mktemp(f"truth_{program}_{plan}_{tp}")
    trace, traced = work / "trace", work / "dump"
    if program == "titan":
        args = ["--plan", plan, "--dump", work / "dumps"]
        traced = work / "dumps" / plan
        walk = truth.titan_truth(plan, tp, plan_styles=tp_api_llama.plan_styles, sizes=tp_api_llama.SIZES)
    else:
        args = ["--ckpt", ref_root.parent / f"{program}-ckpt", "--dump", traced]
        applied = json.loads((ref / "plan.json").read_text())
        script = {"hf-mixtral": tp_hf_mixtral, "hf-olmo2": tp_hf_olmo2,
                  "hf-qwen3": tp_hf_qwen3, "hf-phi3": tp_hf_phi3}.get(program, tp_hf_llama)
        walk = truth.hf_llama_truth(applied["plan"], tp, sizes=script.SIZES, batch=script.BATCH,
                                    seq=script.SEQ, version=applied["transformers"], moe=program == "hf-mixtral",
                                    post_norms=program == "hf-olmo2", head_norms=program == "hf-qwen3",
                                    packed=program == "hf-phi3")
    res = record(trace, _torchrun(program, tp, *args, "--steps", STEPS), timeout=TIMEOUT, check=False)
    assert res.returncode == 0, f"traced {program}/{plan} tp{tp}: exit {res.returncode}\n{res.stderr[-3000:]}"
    got = {p["point"]: p for p in _cli("query", "placement", "*:*", "--trace", trace, "--json")}
    summary = "\n".join(l for l in (res.stdout + res.stderr).splitlines()
                        if l.startswith("tensor-trace:") and "rank(s) in" in l)
    return Case(program, plan, tp, walk, got, ref, traced, trace, summary)


def _probe(case) -> dict:
    """Rank 0's local shapes from the untraced run (every rank's are checked equal)."""
    shapes = [json.loads((case.ref / f"shapes{r}.json").read_text()) for r in range(case.tp)]
    for r, s in enumerate(shapes[1:], 1):
        assert s == shapes[0], f"{case.name}: rank {r}'s local shapes differ from rank 0's"
    return shapes[0]


def _fmt(t: truth.PlannedTensor) -> str:
    return f"{t.placement}/{t.reduction} {list(t.shape)} {t.dtype}"


def _got_fmt(g: dict) -> str:
    shapes = {tuple(s) for s in g.get("shapes", {}).values()}
    shape = str(list(next(iter(shapes)))) if len(shapes) == 1 else str(g.get("shapes"))
    return f"{g.get('placement')}/{g.get('reduction')} {shape}x{len(g.get('shapes', {}))} {g.get('dtype')}"


def _evidence(lines) -> str:
    """The first evidence line that says more than the shapes."""
    lines = list(lines or [])
    useful = [e for e in lines if not e.startswith("same shape")]
    return ((useful or lines or [""])[0])[:110]


def _table(rows, title) -> str:
    if not rows:
        return ""
    heads = ("point", "differs", "expected (from the plan)", "got", "evidence")
    widths = [min(64 if i == 0 else 48, max(len(str(r[i])) for r in rows + [heads])) for i in range(4)]
    out = [title, "  ".join(h.ljust(w) for h, w in zip(heads, widths + [0])).rstrip()]
    for r in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths + [0])).rstrip())
    return "\n".join(out)


def _family(op: str | None) -> str | None:
    for fam in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"):
        if op and op.startswith(fam):
            return fam
    return op


def placement_mismatches(case) -> list:
    """One row per truth point that tensor-trace gets wrong (all of them, not the first)."""
    rows = []
    for point, t in case.walk.points.items():
        g = case.got.get(point)
        if g is None:
            if not t.optional:
                rows.append((point, "missing", _fmt(t), "(no such point)", ""))
            continue
        differs = [f for f, ok in (
            ("placement", g.get("placement") == t.placement),
            ("reduction", g.get("reduction") == t.reduction),
            ("ranks", len(g.get("shapes", {})) == case.tp),
            ("shape", all(tuple(s) == t.shape for s in g.get("shapes", {}).values())),
            ("dtype", g.get("dtype") == t.dtype)) if not ok]
        if differs:
            rows.append((point, ",".join(differs), _fmt(t), _got_fmt(g), _evidence(g.get("evidence"))))
    return rows


def test_truth_agrees_with_the_untraced_run(case):
    """The truth's own check: every point it states exists in an untraced run with that local
    shape and dtype, and every point that run has is stated (nothing left out silently)."""
    seen = _probe(case)
    bad = [f"{p}: truth {list(t.shape)} {t.dtype}, untraced run {seen.get(p)}"
           for p, t in case.walk.points.items()
           if (p in seen and (tuple(seen[p]["shape"]) != t.shape or seen[p]["dtype"] != t.dtype))
           or (p not in seen and not t.optional)]
    unstated = sorted(set(seen) - set(case.walk.points))
    if bad or unstated:
        pytest.fail(f"{case.name}: truth errors:\n" + "\n".join(bad) +
                    ("\nunstated points: " + ", ".join(unstated) if unstated else ""), pytrace=False)


def test_placement_matches_the_plan(case):
    rows = placement_mismatches(case)
    n = sum(1 for p, t in case.walk.points.items() if not t.optional or p in case.got)
    if rows:
        pytest.fail(_table(rows, f"{case.name}: {len(rows)} of {n} points disagree with the plan "
                                 "(query placement --json)"), pytrace=False)


def test_reduction_query_matches_the_plan(case):
    """``query reduction POINT --json`` for every truth point: its verdict and placement, and for
    a post-reduction point the family of the collective that produced it. ``vs-placement``: the
    two queries disagree with each other."""
    rows = []
    for point, t in case.walk.points.items():
        g = case.got.get(point)
        if g is None:
            continue  # reported as missing by the placement test
        r = _cli("query", "reduction", point, "--trace", case.trace, "--json")
        fam = _family((r.get("collective") or {}).get("op"))
        differs = [f for f, ok in (("verdict", r.get("verdict") == t.reduction),
                                   ("placement", r.get("placement") == t.placement),
                                   ("collective", t.collective is None or fam == t.collective),
                                   ("vs-placement", (r.get("verdict"), r.get("placement")) ==
                                    (g.get("reduction"), g.get("placement")))) if not ok]
        if differs:
            exp = f"{t.reduction} {t.placement}" + (f" via {t.collective}" if t.collective else "")
            got = f"{r.get('verdict')} {r.get('placement')}" + (f" via {fam}" if fam else "")
            rows.append((point, ",".join(differs), exp, got, _evidence(r.get("evidence"))))
    if rows:
        pytest.fail(_table(rows, f"{case.name}: {len(rows)} points' query reduction disagrees with the plan"),
                    pytrace=False)


def test_collectives_match_the_plan(case):
    """Per module and step, the collectives the plan issues, and no others (a tracer that
    issued its own would show up here)."""
    got = {}  # (module, family) -> {step: count}
    for c in _cli("query", "collectives", "--trace", case.trace, "--json"):
        per = got.setdefault((c["module"], _family(c["op"])), {})
        for step, n in c["per_step"].items():
            per[int(step)] = per.get(int(step), 0) + n
    expected = case.walk.collectives
    rows = []
    for key in sorted(set(expected) | set(got), key=str):
        want = [expected.get(key, 0)] * STEPS
        have = [got.get(key, {}).get(step, 0) for step in range(STEPS)]
        if want != have:
            rows.append(f"  {key[0] or '<root>':<36} {key[1]:<15} expected {want} per step, got {have}")
    if rows:
        pytest.fail(f"{case.name}: collectives differ from the plan's:\n" + "\n".join(rows), pytrace=False)


def test_tracer_records_without_errors(case):
    errors = _cli("query", "sql", "SELECT location, message, count(*) AS n FROM errors "
                  "GROUP BY location, message", "--trace", case.trace, "--json")
    if errors:
        pytest.fail(f"{case.name}: tracer errors ({case.summary}):\n" + "\n".join(
            f"  {e['n']} x {e['location']}: {e['message']}" for e in errors), pytrace=False)


def test_tracing_does_not_change_results(case):
    """Each rank's logits of every step, traced and untraced, are identical."""
    for r in range(case.tp):
        ref = torch.load(case.ref / f"rank{r}.pt")
        got = torch.load(case.traced / f"rank{r}.pt")
        assert len(ref) == len(got) == STEPS
        for step, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"{case.name}: rank {r} step {step}: traced logits differ " \
                                      f"(max abs diff {(a - b).abs().max().item():g})"
