"""Which ranks hold the same data: a framework's parallel groups, as the processes declared them.

A verdict compares a tensor across the ranks of one group. Most points live in the TP group, but
under SGLang's DP attention (``--enable-dp-attention --dp-size N``) the TP group is split into N
attention-DP ranks, each running its own requests: between the gather before the MoE and the
scatter after it (and in attention, norms and the residual stream) a rank holds only its own
tokens, and only the ranks of its attention-TP group hold the same ones. Those points are judged
across the attention-TP group, and the tokens' split across the DP ranks is reported as a data
split, not as a shard: no collective ever puts these slices together as one tensor of the model.

Which points are DP-local is observed, not named: a point whose first dimension is, on every
rank, that rank's own token count (or its own batch size: per-request tensors such as the
logits) in a step whose DP ranks ran different tokens. Points with the gathered token count on
every rank (the MoE block's) stay in the TP group. The processes declare their groups in their
identity (``groups``: name -> size, rank, ranks; tracer/integrations/sglang.py); traces without
them are judged as before, over their TP groups.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from tensor_trace.exporters.analysis.evidence import item

DP_LOCAL_GROUP = "attn_tp"


def declared_groups(con) -> dict:
    """proc -> its declared parallel groups (``{name: {size, rank, ranks}}``), for the
    processes that declared any."""
    out = {}
    for proc, ident in con.execute("SELECT proc, identity FROM processes WHERE identity IS NOT NULL"):
        try:
            groups = (json.loads(ident) or {}).get("groups")
        except (TypeError, ValueError):
            continue
        if isinstance(groups, dict) and groups:
            out[proc] = groups
    return out


def dp_subgroups(con, procs, rank_of: dict) -> list | None:
    """The attention-TP groups that partition ``procs`` (one TP group), as ``[(procs, size)]``,
    when its processes declared DP attention (an attention-DP group of more than one rank);
    None otherwise."""
    declared = declared_groups(con)
    if not any((declared.get(p, {}).get("attn_dp") or {}).get("size", 1) > 1 for p in procs):
        return None
    by_group: dict = {}
    sizes: dict = {}
    for p in procs:
        g = declared.get(p, {}).get(DP_LOCAL_GROUP)
        key = tuple(g["ranks"]) if g and g.get("ranks") else ("alone", rank_of.get(p))
        by_group.setdefault(key, []).append(p)
        sizes[key] = int(g["size"]) if g and g.get("size") else 1
    return [(members, sizes[key]) for key, members in by_group.items()]


class StepCounts(NamedTuple):
    """One process's counts of a step, as recorded: its own tokens and requests, every DP rank's
    tokens, and the rows it and every DP rank ran once SGLang padded the batch (``rows``,
    ``batch_rows``, ``dp_rows``: in its MAX_LEN mode every DP rank runs as many rows as the
    longest, an idle one too; the counts before padding where the step does not say)."""
    tokens: int | None
    batch: int | None
    dp_tokens: list | None
    rows: int | None
    batch_rows: int | None
    dp_rows: list | None

    def padding(self) -> int:
        """Rows this process ran past its own tokens."""
        return max(0, (self.rows or 0) - (self.tokens or 0))


def step_counts(view) -> dict:
    """proc -> ``StepCounts`` of the view's step."""
    out = {}
    for p, a in view.step_attrs.items():
        tokens, batch, dp_tokens = a.get("tokens"), a.get("batch_size"), a.get("dp_tokens")
        rows = a.get("rows", tokens)
        out[p] = StepCounts(tokens, batch, dp_tokens, rows, a.get("batch_rows", batch), a.get("dp_rows") or dp_tokens)
    return out


# Rules of rules.py that link a point to a collective of the TP group: its values are those of
# every DP rank's tokens (gathered, or a partial sum over them), not one DP rank's own.
LINKED_RULES = {"gather-output", "gathered-by-all-reduce", "reduction-output", "non-sum-reduction-output", "exchange-output",
                "reduction-input",
                "gather-by-all-reduce-input", "gather-input", "reduce-scatter-output"}


def dp_local_points(view, counts: dict, verdicts: dict) -> set:
    """Keys of the step's points that hold each rank's own tokens (``_by_rows``), and of the
    points inside a module call that does (e.g. attention's per-head norms, whose rows are
    tokens times heads): the nearest enclosing call whose own points tell. A point whose rows are
    not its rank's own and whose values meet a collective of the TP group (``verdicts``, across
    the whole TP group) holds every DP rank's tokens: the MoE block's input, its partial sums."""
    procs = view.procs
    if len(counts) < len(procs) or any(counts[p].rows is None for p in procs):
        return set()
    told = {}
    for key, obs in view.points.items():
        says = _by_rows(view, counts, key, obs)
        if says is not True and (verdicts.get(key) or {}).get("rule") in LINKED_RULES:
            says = False
        told[key] = True if says == MAYBE else says
    call_says: dict = {}  # (module, call) -> True (DP-local) / False (gathered): its first point that tells
    for key in sorted(told, key=lambda k: view.times.get(k, (1 << 62, 0, 0))):
        if told[key] is not None:
            call_says.setdefault(key[:2], told[key])
    span_at: dict = {}  # key -> (proc, span index) on the first rank that has it (an idle one may not)
    for (proc, idx, _slot), key in view.slot_key.items():
        if key not in span_at or procs.index(proc) < procs.index(span_at[key][0]):
            span_at[key] = (proc, idx)
    local = set()
    for key, says in told.items():
        # Inside a call that holds every DP rank's tokens (the MoE block) everything does, whatever
        # its rows look like (an expert's tokens may number a rank's own); a gathered call never
        # encloses a DP-local one within a forward pass.
        chain = [call_says.get(key[:2])]
        if key in span_at:
            proc, idx = span_at[key]
            parent = view.span_of[(proc, idx)][2]
            for _ in range(64):  # up the module calls enclosing it
                owner = view.span_of.get((proc, parent))
                if owner is None:
                    break
                chain.append(call_says.get(owner[:2]))
                parent = owner[2]
        if says is False or False in chain:
            continue
        # A point whose values are not finite cannot show that it meets a collective of the TP
        # group (the MoE block's gathered input, padded with uninitialised rows): its rows alone
        # place it, never the call around it.
        if says or (says is None and any(chain) and not any(o.nonfinite for o in view.points[key].values())):
            local.add(key)
    return local


MAYBE = "maybe"


def _by_rows(view, counts, key, obs):
    """True where the point's first dimension is, on every rank that has it and holds tokens,
    that rank's own token count (or its own batch size), and the ranks' counts are not all the
    gathered count; ``MAYBE`` where they match but are also the gathered count (one DP rank holds
    every token: the others are idle); None where its rows do not tell (the gathered count may
    also be a rank's tokens times heads). An idle DP rank runs a padded batch (its rows are not
    tokens of its own) or skips a module altogether (the point is then seen on the others only).

    The counts are those of the rows SGLang ran once it padded the batch, or else of the tokens
    as the step began: the step's own inputs were recorded before the padding."""
    procs = view.procs
    seen = [p for p in procs if p in obs]
    if not seen or any(not obs[p].shape for p in seen):
        return None
    maybe = None
    for own_of, gathered_of, _what in _COUNTS:
        says = _rows_are(procs, seen, obs, counts, own_of, gathered_of)
        if says is True:
            return True
        maybe = maybe or says
    return maybe


# (a rank's own count, every DP rank's, what the rows then are): the rows run after SGLang's
# padding first
_COUNTS = (("rows", "dp_rows", "tokens"), ("batch_rows", "dp_rows", "requests"),
           ("tokens", "dp_tokens", "tokens"), ("batch", "dp_tokens", "requests"))


def _rows_are(procs, seen, obs, counts, own_of, gathered_of):
    """``_by_rows`` by one kind of count."""
    if any(getattr(counts[p], own_of) for p in procs if p not in obs):
        return None  # a rank that ran rows of its own and has no such point
    gathered = getattr(counts[procs[0]], gathered_of)
    holders = [p for p in seen if getattr(counts[p], own_of)] if gathered else seen
    if not holders:
        return None
    own = {p: getattr(counts[p], own_of) for p in holders}
    if any(n is None for n in own.values()) or any(obs[p].shape[0] != n for p, n in own.items()):
        return None
    if gathered and all(n == sum(gathered) for n in own.values()):
        return MAYBE if len(holders) < len(procs) else None
    if len(holders) < len(procs) or len(set(own.values())) > 1 or gathered:
        return True
    return None


def tp_group_info(procs, size, rank_of) -> dict:
    return dict(name="tp", size=size, ranks=[sorted(rank_of[p] for p in procs)])


def rejudge_dp_local(ctx, con, step, view, verdicts: dict, subgroups: list) -> None:
    """Replace the verdicts of the step's DP-local points (``verdicts`` of the whole TP group)
    with their verdicts across their attention-TP groups, and say how the tokens are split."""
    counts = step_counts(view)
    local = dp_local_points(view, counts, verdicts)
    rank_of = ctx.rank_of
    for key, verdict in verdicts.items():
        verdict.setdefault("group", tp_group_info(view.procs, len(view.procs), rank_of))
    if not local:
        return
    per_group = []
    for members, size in subgroups:
        _, sub = ctx.judge_step(con, step, members, size)
        per_group.append((members, size, sub))
    for key in local:
        whole = verdicts[key]
        if whole["placement"] == "unknown" and all(o.fp is None for o in view.points[key].values()):
            # Without values no collective could show that the point holds every DP rank's
            # tokens (an expert's input may number a rank's own tokens): where its shapes did
            # not place it either, its rows alone do not make it DP-local, nor its one-rank
            # attention-TP group make it whole.
            continue
        found = [(members, size, sub[key]) for members, size, sub in per_group if key in sub]
        if not found:
            continue
        # the first DP rank that holds tokens speaks for the point; the others' verdicts are evidence
        # (a DP rank's own tokens before the rows SGLang padded its batch with)
        found.sort(key=lambda f: (-sum(counts[p].tokens or 0 for p in f[0] if p in view.points[key]),
                                  -sum(view.points[key][p].shape[0] for p in f[0] if p in view.points[key])))
        members, size, chosen = found[0]
        seen = [p for p in view.procs if p in view.points[key]]
        rows = {rank_of[p]: view.points[key][p].shape[0] for p in seen}
        counted, what = next(((c, w) for c, _, w in _COUNTS if all(
            rows[rank_of[p]] == getattr(counts[p], c) for p in ([p for p in seen if getattr(counts[p], c)] or seen))),
            (None, "rows"))
        split = dict(over="attn_dp", dim=0, rows=rows, what=what)
        padded = {rank_of[p]: counts[p].padding() for p in seen if counted == "rows" and counts[p].padding()}
        if padded:
            split["padding"] = padded
        text = (f"data split over the attention-DP ranks: each holds its own {split['what']} along dim 0 ("
                + ", ".join(f"rank {r}: {n}" + (f" ({padded[r]} of them padding)" if r in padded else "")
                            for r, n in sorted(rows.items()))
                + f"); judged across its attention-TP group ({size} rank{'s' if size > 1 else ''})")
        items = [item("group", text)] + list(chosen["items"])
        for other_members, _, other in found[1:]:
            if (other["placement"], other["reduction"]) != (chosen["placement"], chosen["reduction"]):
                items.append(item("group", f"attention-TP group {sorted(rank_of[p] for p in other_members)}: "
                                           f"{other['placement']}/{other['reduction']}"))
        new = dict(chosen, items=items, shapes=whole["shapes"], dtypes=whole["dtypes"],
                   group=dict(name=DP_LOCAL_GROUP, size=size,
                              ranks=[sorted(rank_of[p] for p in m) for m, _, _ in per_group]),
                   data_split=split)
        verdicts[key] = new
