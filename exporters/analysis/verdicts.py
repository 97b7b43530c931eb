"""The ``points`` table: every capture point's verdict, voted over a few sampled steps of each
kind, with its evidence rendered to text and kept as structured items."""

from __future__ import annotations

import collections
import json

from tensor_trace import schema
from tensor_trace.exporters.analysis import declared, groups
from tensor_trace.exporters.analysis.evidence import ONE_ROW_SCALE, READ_FROM_ASKED, UNCONFIRMED_SCALE, item, texts
from tensor_trace.exporters.analysis.judge import Judge
from tensor_trace.exporters.analysis.step_view import StepView
from tensor_trace.format.fingerprints import decode_fingerprints
from tensor_trace.format.points import point_name

MAX_SAMPLE_STEPS = 3


def load_params(con) -> dict:
    """(proc, module path) -> [(name, local shape, fingerprint, meta)] of its own parameters."""
    static = {}
    for proc, first, data, indices in con.execute(
            "SELECT proc, first, data, indices FROM fingerprints WHERE step=?", (schema.PARAMS_STEP,)):
        decode_fingerprints(first, data, indices, static, key=lambda i, proc=proc: (proc, i))
    for proc, idx, s, q in con.execute("SELECT proc, idx, sum, sumsq FROM wide_fingerprints WHERE step=?",
                                       (schema.PARAMS_STEP,)):
        static[(proc, idx)] = (s, q)
    has_meta = any(r[1] == "meta" for r in con.execute("PRAGMA table_info(params)"))
    out: dict = {}
    for proc, path, name, shape, ref, meta in con.execute(
            f"SELECT p.proc, m.path, p.name, p.shape, p.fp_index, {'p.meta' if has_meta else 'NULL'} "
            f"FROM params p JOIN modules m USING(module_id)"):
        out.setdefault((proc, path), []).append(
            (name, tuple(json.loads(shape)), static.get((proc, ref)), json.loads(meta) if meta else None))
    return out


def tp_groups(con) -> list:
    """Processes partitioned into TP groups: declared ``tp_ranks``, else one group per world."""
    return [procs for procs, _ in tp_groups_with_size(con)]


def tp_groups_with_size(con) -> list:
    """[(procs, size)]: each TP group's readable processes and its size as the processes
    declared it (their TP ranks, else the world size), never as counted from readable files."""
    rows = con.execute("SELECT proc, rank, tp_ranks, world_size FROM processes "
                       "ORDER BY rank IS NULL, rank, proc").fetchall()
    mesh = _mesh_groups(con, {proc: rank for proc, rank, _, _ in rows})
    groups: dict = {}
    sizes: dict = {}
    for proc, rank, tp_ranks, world in rows:
        if rank is None:
            key, size = ("alone", proc), 1
        elif not tp_ranks and proc in mesh:
            key, size = ("mesh", tuple(mesh[proc])), len(mesh[proc])
        elif tp_ranks:
            key = ("tp", tp_ranks)
            try:
                size = len(json.loads(tp_ranks))
            except (TypeError, ValueError):
                size = None
        else:
            key, size = ("world", world), world
        groups.setdefault(key, []).append(proc)
        sizes[key] = max(sizes.get(key, 0), size or 0)
    return [(procs, sizes[key] or len(procs)) for key, procs in groups.items()]


def _mesh_groups(con, rank_of: dict) -> dict:
    """proc -> its TP group's ranks, for processes that declared none but hold DTensor
    parameters: on a TP sub-mesh, or on a mesh of data and tensor parallel dimensions. Judging
    their points across the whole world would compare different data."""
    if not any(r[1] == "meta" for r in con.execute("PRAGMA table_info(params)")):
        return {}
    out = {}
    for proc, meta in con.execute("SELECT proc, meta FROM params WHERE meta IS NOT NULL ORDER BY proc, rowid"):
        if proc in out or rank_of.get(proc) is None:
            continue
        try:
            group = declared.tp_group_of(json.loads(meta), rank_of[proc])
        except (TypeError, ValueError):
            group = None
        if group:
            out[proc] = group
    return out


def inferred_tp_ranks(con) -> dict:
    """TP rank per process: as recorded, or the position in its TP group (the merge's grouping:
    declared groups, else all ranks of the world)."""
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    recorded = dict(con.execute("SELECT proc, tp_rank FROM processes WHERE tp_rank IS NOT NULL"))
    out = {}
    for procs in tp_groups(con):
        ranked = sorted((rank_of[p], p) for p in procs if rank_of.get(p) is not None)
        for pos, (_, p) in enumerate(ranked):
            out[p] = recorded.get(p, pos)
    return out


def group_steps(con, procs) -> list:
    """[(step, kind, fingerprinted)]: the complete steps every process of the group traced, in
    order, each with its kind (root, mode, captured, replay) and whether every process took
    fingerprints in it (``record --fingerprint-every``: only some steps do)."""
    ph = ",".join("?" * len(procs))
    rows = con.execute(
        f"SELECT step, root, attrs, MIN(COALESCE(fingerprinted, 0)) FROM steps WHERE proc IN ({ph}) "
        f"AND t_end IS NOT NULL GROUP BY step HAVING COUNT(*) = ? ORDER BY step", (*procs, len(procs))).fetchall()
    out = []
    for step, root, attrs, fingerprinted in rows:
        a = json.loads(attrs or "{}")
        out.append((step, (root, a.get("forward_mode"), a.get("captured"), a.get("replay_of") is not None),
                    bool(fingerprinted)))
    return out


def sample_steps(con, procs) -> list:
    """A few steps every process of the group traced, one set per kind of step (root, mode):
    steps with fingerprints, whose values are evidence; a kind without any is sampled all the
    same (its shapes and collectives still are)."""
    kinds: dict = {}
    for step, kind, fingerprinted in group_steps(con, procs):
        kinds.setdefault(kind, ([], []))[0 if fingerprinted else 1].append(step)
    return sorted(s for with_fp, without in kinds.values() for s in (with_fp or without)[:MAX_SAMPLE_STEPS])


def unfingerprinted_note(con, procs, step) -> str | None:
    """Evidence for a verdict of ``step`` when the step took no fingerprints on some process of
    the group: which steps of its kind did. None when it did."""
    rows = group_steps(con, procs)
    kind = next((k for s, k, fp in rows if s == step), None)
    fp_here = con.execute(f"SELECT MIN(COALESCE(fingerprinted, 0)) FROM steps WHERE step=? AND proc IN "
                          f"({','.join('?' * len(procs))})", (step, *procs)).fetchone()[0]
    if fp_here is None or fp_here:
        return None
    if not any(fp for _, _, fp in rows):
        return f"step {step} was not fingerprinted, nor was any step (recorded with --no-fingerprint?)"
    same = [s for s, k, fp in rows if fp and k == kind]
    listed = ", ".join(map(str, same[:8])) + (" ..." if len(same) > 8 else "") if same else "none"
    return (f"step {step} was not fingerprinted (fingerprinted steps of this kind: {listed}; "
            f"record --fingerprint-every 1 for all)")


class StoreContext:
    """What every step's judge of one store reads once."""

    def __init__(self, con):
        self.layouts = {lid: json.loads(s) for lid, s in con.execute("SELECT layout_id, slots FROM layouts")}
        self.modules = dict(con.execute("SELECT module_id, path FROM modules"))
        self.rank_of = {p: (r if r is not None else 0) for p, r in con.execute("SELECT proc, rank FROM processes")}
        self.params = load_params(con)
        self.layer_attrs = {m: json.loads(a) for m, a in con.execute("SELECT module, attrs FROM module_attrs")}

    def judge_step(self, con, step, procs, size, subgroups=None) -> tuple:
        """The step's verdicts across one TP group; with ``subgroups`` (its attention-TP groups
        under DP attention: ``groups.dp_subgroups``) the points that hold each DP rank's own
        tokens are judged across those instead."""
        view = StepView(con, step, procs, self.layouts, self.modules, self.rank_of)
        judge = Judge(view, self.params, self.rank_of, size, self.layer_attrs)
        verdicts = judge.judge_all()
        if subgroups:
            groups.rejudge_dp_local(self, con, step, view, verdicts, subgroups)
        return view, verdicts


def _semantics_check(sem, placement, reduction, items) -> None:
    agrees = (placement.startswith("shard(") if sem["placement"] == "shard" else placement == sem["placement"])
    if sem.get("reduction"):
        agrees = agrees and reduction == sem["reduction"]
    sem["agrees"] = agrees
    items.append(item("semantics", f"{sem['says']}: {sem['placement']}"
                      + (f"/{sem['reduction']}" if sem.get("reduction") else "")
                      + (" (agrees with the observed evidence)" if agrees else
                         f" -- DISAGREES with the observed {placement}/{reduction}")))


def calls_seen(con) -> list:
    """[(module_id, call, spans)] of the first process with spans. The merge counts them while
    it loads that file and leaves them in a TEMP table of its connection (``first_proc_calls``,
    store/merge.py); elsewhere they are grouped from the store."""
    if con.execute("SELECT 1 FROM temp.sqlite_master WHERE name = 'first_proc_calls'").fetchone():
        return con.execute("SELECT module_id, call, n FROM temp.first_proc_calls").fetchall()
    bounds = con.execute("SELECT MIN(span_first), MAX(span_last) FROM steps WHERE proc = "
                         "(SELECT MIN(proc) FROM steps WHERE span_first IS NOT NULL)").fetchone()
    return con.execute("SELECT module_id, call, COUNT(*) FROM spans WHERE rowid BETWEEN ? AND ? "
                       "GROUP BY module_id, call", bounds).fetchall()


def compute_verdicts(con) -> int:
    """Fill the ``points`` table; return the number of points."""
    ctx = StoreContext(con)
    per_point: dict = {}
    multi: collections.Counter = collections.Counter()
    group_info = []
    for gi, (procs, size) in enumerate(tp_groups_with_size(con)):
        group_info.append(groups.tp_group_info(procs, size, ctx.rank_of))
        subgroups = groups.dp_subgroups(con, procs, ctx.rank_of)
        for step in sample_steps(con, procs):
            view, verdicts = ctx.judge_step(con, step, procs, size, subgroups)
            for m, c in view.max_call.items():
                multi[m] = max(multi[m], c)
            for key, verdict in verdicts.items():
                verdict["step"] = step
                verdict["order"] = view.times.get(key, (1 << 62, 0, 0))
                verdict["tp_group"] = gi
                per_point.setdefault(key, []).append(verdict)
    # traced steps each (module, call) was seen in, on the first process
    seen_steps = {(ctx.modules[mid], call): n for mid, call, n in calls_seen(con)}
    captures = {p: json.loads(i) for p, i in con.execute("SELECT point, info FROM captures")}
    lineage_steps = {s for (s,) in con.execute("SELECT DISTINCT step FROM lineage")}
    rows = []
    for key, all_verdicts in per_point.items():
        for verdicts, others in _by_group(all_verdicts, lineage_steps):
            rows.append(_point_row_of(ctx, key, verdicts, others, group_info, multi, seen_steps, captures,
                                      lineage_steps))
    rows.sort(key=lambda r: (r[14], r[0], r[17] or ""))
    con.executemany("INSERT INTO points VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [r[:14] + (i,) + r[15:] for i, r in enumerate(rows)])
    return len(rows)


def _by_group(verdicts: list, lineage_steps: set) -> list:
    """[(verdicts, other groups' answers)]: one vote over every TP group's verdicts where the
    groups agree (data-parallel replicas of one model: one row); one per group where they do
    not, each naming the others' (pipeline stages whose modules share names: stage 1's
    ``layers.0`` is another tensor than stage 0's, and one row would hide it)."""
    by: dict = {}
    for v in verdicts:
        by.setdefault(v["tp_group"], []).append(v)
    if len(by) < 2:
        return [(verdicts, [])]
    answers = {g: tuple(vote(vs, lineage_steps)[4][k] for k in ("placement", "reduction")) for g, vs in by.items()}
    if len(set(answers.values())) == 1:
        return [(verdicts, [])]
    return [(vs, [(h, answers[h]) for h in by if h != g]) for g, vs in by.items()]


def _point_row_of(ctx, key, verdicts, others, group_info, multi, seen_steps, captures, lineage_steps) -> tuple:
    """One row of the points table: ``verdicts`` voted (``others``: the other TP groups' own
    answers, where this row is one group's)."""
    module, call, slot = key
    blind, unwatched, voting, counts, chosen = vote(verdicts, lineage_steps)
    placement, reduction = chosen["placement"], chosen["reduction"]
    items = list(chosen["items"])
    if module in captures and captures[module].get("what"):
        items.insert(0, item("capture", f"captures the {captures[module]['what']}"))
    items.append(item("sampling", f"steps sampled: {sorted({v['step'] for v in verdicts})}"))
    if blind and len(voting) < len(verdicts):
        items.append(item("sampling", f"unknown in steps {sorted({v['step'] for v in blind})} (not enough "
                                      "evidence there): not counted"))
    # (said only where those steps disagree: the same verdict left uncounted is no news)
    other = [v for v in unwatched if (v["placement"], v["reduction"]) != (placement, reduction)]
    if other and len(voting) < len(verdicts):
        said = sorted({v["placement"] for v in other})
        items.append(item("sampling", f"{' or '.join(said)} in steps {sorted({v['step'] for v in other})}, "
                                      "whose ops were not recorded (lineage is taken on a schedule): "
                                      "not counted"))
    read = [v for v in verdicts if v not in voting and _read_from_asked(v)]
    if read:
        said = sorted({v["placement"] for v in read})
        items.append(item("sampling", f"{' or '.join(said)} in steps {sorted({v['step'] for v in read})}, "
                                      "from a reshape's -1 alone (the local shape unchanged): not counted"))
    if len(counts) > 1:
        items.append(item("sampling", "other steps disagree: " + ", ".join(
            f"{p}/{r} in {n}" for (p, r), n in counts.items() if (p, r) != (placement, reduction))))
    judged_across = (chosen.get("group") or {}).get("size") or len(chosen["shapes"])
    sem = declared.expected_by_layer(ctx.layer_attrs.get(module), slot, judged_across)
    if sem is not None:
        _semantics_check(sem, placement, reduction, items)
    grouping = _grouping(chosen)
    if others:
        info = group_info[verdicts[0]["tp_group"]]
        items.insert(0, item("group", f"judged across TP group {info['ranks'][0]}; "
                                      + "; ".join(f"TP group {group_info[g]['ranks'][0]} holds another tensor "
                                                  f"under this name: {p}/{r}" for g, (p, r) in others)
                                      + " (each group's row is its own)"))
        grouping = grouping or json.dumps(dict(group=info, data_split=None))
    judged_in = sorted({v["tp_group"] for v in verdicts})
    if len(judged_in) > 1 and not grouping:
        # judged alike by several TP groups (data-parallel replicas, pipeline stages' modules of
        # one name), each on its own: the shapes are one group's, the group says which ranks
        info = group_info[judged_in[0]]
        grouping = json.dumps(dict(group=dict(name=info["name"], size=info["size"],
                                              ranks=[group_info[g]["ranks"][0] for g in judged_in]),
                                   data_split=None))
    shapes, dtypes = chosen["shapes"], chosen["dtypes"]
    dts = set(dtypes.values())
    return (point_name(module, call, slot, multi[module] > 0), module, call, slot, placement,
            reduction, json.dumps(shapes), dts.pop() if len(dts) == 1 else None,
            json.dumps(dtypes) if len(dts) > 1 else None,
            seen_steps.get((module, call), 0), json.dumps(texts(items)),
            json.dumps(chosen["collective"]) if chosen["collective"] else None,
            json.dumps(verdicts[0]["fp"]) if verdicts[0]["fp"] else None,
            json.dumps(sem) if sem is not None else None,
            min(v["order"][0] for v in verdicts), chosen["rule"], json.dumps(items),
            grouping)


# Rules whose answer rests on recorded ops (or on a point that they placed): a step without
# ops cannot reach it. A value rule (sums-add-up, a concatenation seen...) can in any step with
# fingerprints, so a step where it did not is evidence against it, and votes.
_OPS_RULES = frozenset(("lineage-ops", "derived-from-shard", "same-values"))


def vote(verdicts: list, lineage_steps: set) -> tuple:
    """The sampled steps' verdicts of one point, voted: ``(blind, unwatched, voting, counts,
    chosen)``. A step without the evidence to judge the point (no usable fingerprints there:
    unknown/unknown) does not vote against the steps that had it. Nor does one where no op was
    recorded (lineage is taken on a schedule) and the point is left divergent, against steps
    with recorded ops that placed it as a shard or a partial sum by those ops (``_OPS_RULES``):
    values that differ across ranks are what those predict, so the step without ops says
    nothing against them (a replicate point, or one placed by its values alone, stays outvoted
    by it); nor, there, a rule that follows the dataflow without those ops."""
    blind = [v for v in verdicts if v["placement"] == "unknown" and v["reduction"] == "unknown"]
    placed = any(v["step"] in lineage_steps and v["rule"] in _OPS_RULES and
                 (v["placement"].startswith("shard(") or v["placement"] == "partial") for v in verdicts)
    # (nor do such a step's own guesses along the dataflow: a shard derived from the latest one
    # before it, without the reshape between them that only recorded ops show)
    # (nor, in a step whose shards are identical, values equal on every rank: a shard's too)
    unwatched = [v for v in verdicts if placed and v["step"] not in lineage_steps and
                 (v["rule"] == "divergent" or v["rule"] in _OPS_RULES or
                  (v["rule"] == "equal-values" and v.get("identical_shards")))]
    voting = [v for v in verdicts if v not in blind and v not in unwatched] or verdicts
    # A shard that a local no-op reshape's -1 alone placed (a decode step's [1, q_size] viewed
    # (-1, q_size)) says nothing against steps whose shapes placed the point by the same ops.
    read = [v for v in voting if _read_from_asked(v)]
    if read and len(read) < len(voting):
        voting = [v for v in voting if v not in read]
    # A step where the point is one row (a decode step's token) cannot tell a common scale of a
    # sum-reduction's output (Gemma's embedding times sqrt(hidden)) from a norm of that row, nor
    # one whose sums are too near zero to confirm a scale its sums of squares fit: it says
    # nothing against steps that found the scaled output.
    if any(v["rule"] == "reduction-output" for v in voting):
        voting = [v for v in voting if v["rule"] == "reduction-output" or not _one_row_scale(v)]
    counts = collections.Counter((v["placement"], v["reduction"]) for v in voting)
    (placement, reduction), _ = counts.most_common(1)[0]
    chosen = next(v for v in voting if (v["placement"], v["reduction"]) == (placement, reduction))
    return blind, unwatched, voting, counts, chosen


def _one_row_scale(v) -> bool:
    return any(i["kind"] in (ONE_ROW_SCALE, UNCONFIRMED_SCALE) for i in v.get("items", ()))


def _read_from_asked(v) -> bool:
    return any(i["kind"] == READ_FROM_ASKED for i in v.get("items", ()))


def _grouping(verdict) -> str | None:
    """The group a point was judged across and how its data is split across groups (JSON), for
    traces whose processes declared their groups."""
    if not verdict.get("group"):
        return None
    return json.dumps(dict(group=verdict["group"], data_split=verdict.get("data_split")))
