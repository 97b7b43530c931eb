"""Verdicts for the points of one TP group in one step: the rules of ``rules.py`` applied in
execution order, so that a point's inputs (and the module's parameters) are judged before its
outputs and placement propagates along the step's dataflow."""

from __future__ import annotations

import bisect
import math

from tensor_trace.exporters.analysis import declared, rules
from tensor_trace.exporters.analysis.evidence import Verdict, item
from tensor_trace.exporters.analysis.step_view import EXCHANGE, GATHER, REDUCING, coll_desc
from tensor_trace.exporters.analysis.tolerance import Observed, fp_equal, linked, sum_tol
from tensor_trace.format.points import is_output, point_name

_LINKED_OPS = REDUCING | GATHER | EXCHANGE


class Point:
    """One point of the step as the rules see it: its tensor on each rank and what has been
    observed about it so far (``items``)."""

    __slots__ = ("key", "module", "call", "slot", "obs", "procs", "ts", "tref", "t_point", "items",
                 "equal", "is_output", "_links")

    def __init__(self, key, obs, procs, t_point):
        self.key = key
        self.module, self.call, self.slot = key
        self.obs, self.procs, self.t_point = obs, procs, t_point
        self.ts = [obs[p] for p in procs]
        self.tref = self.ts[0] if self.ts else None
        self.items: list = []
        self.equal = None
        self.is_output = is_output(self.slot)
        self._links = None

    @property
    def ndim(self) -> int:
        return len(self.tref.shape)


def _rows_of_flattened(whole, part, n) -> bool:
    """Whether ``n`` tensors of shape ``part`` put together along dim 0 make ``whole`` with its
    leading dims flattened into one (``[2, 8, 32]`` of four ``[4, 32]``)."""
    k = len(whole) - len(part) + 1
    return (len(part) >= 1 and k > 1 and tuple(whole[k:]) == tuple(part[1:])
            and math.prod(whole[:k]) == n * part[0])


class Judge:
    """Verdicts for the points of one TP group in one step."""

    def __init__(self, view, params: dict, rank_of: dict, group_size: int | None = None,
                 layer_attrs: dict | None = None):
        self.v = view
        self.params = params  # (proc, module) -> [(name, shape, fp, meta)]
        self.rank_of = rank_of
        self.group_size = group_size or len(view.procs)
        self.layer_attrs = layer_attrs or {}
        self.done: dict = {}  # key -> Verdict
        self.inputs_of: dict = {}  # (module, call) -> [keys of its input slots judged so far]
        self.by_fp0: dict = {}  # (fingerprint, numel) on the first proc -> key of its producer
        self.latest_fp0: dict = {}  # (fingerprint, numel) -> the latest module output of those values
        # a point of this step was judged a shard although its values are equal on every rank:
        # the ranks' shards are identical (dummy weights), so equal values say nothing of a place
        self.identical_shards = False
        self.dtensor_experts: dict = {}  # module path -> experts.dtensor_experts, found once a step
        # points whose values read equal on every rank only because their fingerprints are too
        # alike to tell apart (rules._too_alike): judged as values that differ
        self.alike: list = []
        self._params_by_shape: dict | None = None  # shape -> [(module, parameter index)]: params_of_shape

    def producer(self, t):
        """The point that first output these very values (``t``'s fingerprint on the first
        process), or None."""
        return self.by_fp0.get((t.fp, t.numel)) if t is not None and t.fp is not None else None

    def latest_producer(self, t):
        """The latest module output judged so far with these very values (``t``'s fingerprint
        on the first process), or None: where an addend vanishes in the fingerprint (dummy
        weights' tiny layer outputs), a residual sum reads as the embedding's output it was
        built from; what handed these values on is the latest of them."""
        return self.latest_fp0.get((t.fp, t.numel)) if t is not None and t.fp is not None else None

    def name(self, key) -> str:
        """A point's name as queries show it (``#K`` where its module runs more than once)."""
        module, call, slot = key
        return point_name(module, call, slot, self.v.max_call[module] > 0)

    def ranks(self, procs) -> list:
        return sorted(self.rank_of[p] for p in procs)

    def judge_all(self) -> dict:
        """Every point of the step, as ``{key: verdict dict}`` (placement, reduction, rule,
        items, collective, shapes, dtypes, fp)."""
        v = self.v
        out = {}
        for key in sorted(v.points, key=lambda k: v.times.get(k, (1 << 62, 0, 0))):
            obs = v.points[key]
            procs = [p for p in v.procs if p in obs]
            pt = Point(key, obs, procs, v.times.get(key, (0, 0, 0))[0])
            verdict = self.judge(pt)
            self.done[key] = verdict
            if not pt.is_output:
                self.inputs_of.setdefault(key[:2], []).append(key)
            d = verdict.as_dict()
            d["shapes"] = {self.rank_of[p]: list(obs[p].shape) for p in procs}
            d["dtypes"] = {self.rank_of[p]: obs[p].dtype for p in procs}
            d["fp"] = list(pt.tref.fp) if pt.tref is not None and pt.tref.fp is not None else None
            out[key] = d
            t0 = obs.get(v.procs[0])
            if t0 is not None and t0.fp is not None and pt.is_output:
                self.by_fp0.setdefault((t0.fp, t0.numel), key)
                self.latest_fp0[(t0.fp, t0.numel)] = key
        for d in out.values():  # (verdicts.vote: equal values in such a step say nothing of a place)
            d["identical_shards"] = self.identical_shards
        return out

    def judge(self, pt: Point) -> Verdict:
        for rule in rules.RULES:
            verdict = rule(self, pt)
            if verdict is not None:
                if verdict.placement.startswith("shard("):
                    self._note_repeated_slices(pt, verdict)
                elif verdict.placement == "divergent" and rule is not rules.divergent:
                    rules.note_undeclared_groups(self, verdict)  # (a reduction's output, each group's own)
                return verdict
        raise AssertionError("the last rule always decides")  # rules.divergent

    def _note_repeated_slices(self, pt: Point, verdict: Verdict) -> None:
        """A shard whose ranks fall into groups of equal values, but not all into one (vLLM
        replicates each KV head on tp / num_kv_heads ranks): the slices are not distinct, and
        the ranks' pieces put together repeat them. Said, so that nobody concatenates blindly."""
        ts = pt.ts
        if len(ts) < 3 or any(t.fp is None for t in ts):
            return
        classes: list = []
        for p, t in zip(pt.procs, ts):
            for members in classes:
                if fp_equal(pt.obs[members[0]], t):
                    members.append(p)
                    break
            else:
                classes.append([p])
        if len(classes) == 1 or all(len(m) == 1 for m in classes):
            return
        held = "; ".join(f"ranks {self.ranks(m)}" for m in classes if len(m) > 1)
        verdict.items.append(item("values", f"equal values on {held}: each of {len(classes)} distinct slices is "
                                            "held by more than one rank (e.g. KV heads replicated where TP exceeds "
                                            "their number), so the ranks' pieces put together repeat them"))

    # ------------------------------------------------------------------ lookups for the rules
    def call_inputs(self, pt: Point) -> list:
        """Verdicts of the inputs of the same module call, in slot order."""
        return [(k, self.done[k]) for k in self.inputs_of.get(pt.key[:2], ())]

    def call_collectives(self, pt: Point) -> list:
        """The collectives the module call a point belongs to issued itself (a child's are the
        child's, whose own points say what they made): where there are any, the call's output
        was not computed locally from its inputs."""
        t = self.v.times.get(pt.key)
        return self.v.issued_by(t[1]) if t is not None else []

    def output_collectives(self, pt: Point) -> list:
        """``call_collectives`` less those that moved only statistics: a collective each of whose
        tensors holds at most half as many elements as the point (a norm over a hidden dim split
        across ranks all-reduces each row's sum of squares, [t, 1] against [t, h/tp]) cannot have
        made the point's values, which the call then computed locally from its inputs and the
        statistic, replicated once reduced. Each one left out is said in the point's evidence."""
        colls = self.call_collectives(pt)
        if not colls or pt.tref is None:
            return colls
        n, p0 = pt.tref.numel, pt.procs[0]
        small = [c for c in colls if (ts := (c.ins.get(p0) or []) + (c.outs.get(p0) or []))
                 and all(2 * t.numel <= n for t in ts)]
        for c in small:
            note = item("dataflow", f"its call issued {coll_desc(c)} of fewer elements than this tensor holds "
                                    f"({max(t.numel for t in (c.ins.get(p0) or []) + (c.outs.get(p0) or []))} "
                                    f"against {n}): a statistic it used, not these values")
            if note not in pt.items:
                pt.items.append(note)
        return [c for c in colls if c not in small]

    def links(self, pt: Point) -> tuple:
        """Where the point's values meet a collective, found once per point: ``(outputs,
        inputs)``, each a list of ``(collective, position, scale)`` with ``scale`` the common
        factor on every rank; outputs of collectives issued before the point (the latest
        first), inputs of collectives ending after it (the nearest first)."""
        if pt._links is None:
            p0, ref, procs = pt.procs[0], pt.tref, pt.procs
            outs, ins = [], []
            later = list(self.v.after(pt.t_point, _LINKED_OPS))
            if not pt.is_output:
                # the call's own collectives take its inputs too where they ran before its span
                # began (a forward pre-hook's: PrepareModuleInput gathering a keyword input)
                later += [c for c in self.call_collectives(pt) if c.op in _LINKED_OPS and c not in later]
            for found, side, colls in ((outs, "outs", self.v.before(pt.t_point + 1, _LINKED_OPS)),
                                       (ins, "ins", later)):
                for c in colls:
                    per = getattr(c, side)
                    for i, t in enumerate(per.get(p0) or ()):
                        if t.numel != ref.numel or t.fp is None:
                            continue  # the cheap test first: most collectives are other sizes
                        cand = {p: per[p][i] for p in procs if len(per.get(p) or ()) > i}
                        if len(cand) < len(procs):
                            continue
                        scale = linked(cand, pt.obs) if side == "outs" else linked(pt.obs, cand)
                        if scale is not None:
                            found.append((c, i, scale))
            pt._links = (outs, ins)
        return pt._links

    def concat_dim(self, pt: Point):
        """The dimension D such that a tensor of this step is the ranks' tensors put together
        along D (found by its fingerprint: the sum of theirs)."""
        ts, tref = pt.ts, pt.tref
        n = len(ts)
        s_total = sum(t.fp[0] for t in ts)
        q_total = sum(t.fp[1] or 0 for t in ts)
        want = Observed(tref.shape, tref.dtype, (s_total, q_total))
        want.numel = tref.numel * n
        sums, items = self.v.by_numel.get(tref.numel * n, ((), ()))
        tol = sum_tol(want.numel, q_total, tref.dtype) + 1e-7 * abs(s_total)
        lo = bisect.bisect_left(sums, s_total - 2 * tol)
        hi = bisect.bisect_right(sums, s_total + 2 * tol)
        flat = buffer = None
        for _, key, cand in items[lo:hi]:
            if len(cand.shape) != len(tref.shape):
                if flat is None and _rows_of_flattened(cand.shape, tref.shape, n) and fp_equal(want, cand):
                    flat = key
                continue
            diff = [d for d in range(len(tref.shape)) if cand.shape[d] != tref.shape[d]]
            if len(diff) == 1 and cand.shape[diff[0]] == tref.shape[diff[0]] * n and fp_equal(want, cand):
                if key is not None:
                    return diff[0], key
                # a collective's own buffer (an all_gather's output, always along dim 0) is
                # the program's whole only where no point of the step is: spmd_types gathers
                # a sequence shard along dim 0, then cuts and concatenates it along dim 1
                buffer = buffer or (diff[0], key)
        if buffer is not None:
            return buffer
        # each rank's rows of the whole with its leading dims flattened (``x.reshape(-1, h)[r *
        # n:(r + 1) * n]``: an expert-parallel layer's own tokens)
        return (0, flat) if flat is not None else None

    def module_params(self, module, procs) -> list | None:
        per = [self.params.get((p, module)) for p in procs]
        if any(x is None for x in per):
            return None
        return per

    def residual_sum(self, key) -> str | None:
        """What the layer class of ``key``'s module says of it as a residual sum, or None."""
        module, call, slot = key
        attrs = self.layer_attrs.get(module)
        if not attrs or attrs.get("residual_sum_output") != slot:
            return None
        inputs = sum(1 for k in self.v.points if k[0] == module and k[1] == call and k[2].startswith("input"))
        return declared.residual_sum(attrs, slot, inputs)

    def enclosing_shard(self, pt: Point, shape=None, whole=False, ndim=None):
        """The latest shard point before ``pt`` under the same enclosing module call (with
        ``shape``: the latest of that local shape; ``ndim``: of that many dims; ``whole``: the
        latest replicate one)."""
        v = self.v
        proc = v.procs[0]
        t_key = v.times.get(pt.key)
        if t_key is None:
            return None
        parent = v.span_of.get((proc, t_key[1]), (None, None, -1))[2]
        best = None
        for other, verdict in self.done.items():
            if not (verdict.placement == "replicate" if whole else verdict.placement.startswith("shard")):
                continue
            t_o = v.times.get(other)
            if t_o is None or t_o >= t_key:
                continue
            if shape is not None or ndim is not None:
                o = v.points[other].get(proc)
                if o is None or (shape is not None and tuple(o.shape) != shape) \
                        or (ndim is not None and len(o.shape) != ndim):
                    continue
            if v.span_of.get((proc, t_o[1]), (None, None, -2))[2] == parent or t_o[1] == parent:
                if best is None or t_o > v.times[best]:
                    best = other
        return best

    def params_of_shape(self, shape: tuple) -> list:
        """``[(module, parameter index)]`` of the parameters of local shape ``shape`` (the
        first process's records; every rank's module holds the same parameter list)."""
        if self._params_by_shape is None:
            self._params_by_shape = {}
            p0 = self.v.procs[0]
            for (proc, module), params in self.params.items():
                if proc == p0:
                    for i, (_name, pshape, fp, _meta) in enumerate(params):
                        if fp is not None:
                            self._params_by_shape.setdefault(tuple(pshape), []).append((module, i))
        return self._params_by_shape.get(tuple(shape), [])

    def inner_shard(self, pt: Point):
        """The latest shard point before ``pt`` made inside ``pt``'s own module call (by the
        modules it called), or None."""
        v = self.v
        proc = v.procs[0]
        t_key = v.times.get(pt.key)
        if t_key is None:
            return None
        own = t_key[1]
        best = None
        for other, verdict in self.done.items():
            t_o = v.times.get(other)
            if t_o is None or t_o >= t_key or t_o[1] == own or not verdict.placement.startswith("shard"):
                continue
            if best is not None and t_o <= v.times[best]:
                continue
            span, inside = t_o[1], False
            for _ in range(64):  # up the calls enclosing the other point's
                owner = v.span_of.get((proc, span))
                if owner is None:
                    break
                span = owner[2]
                if span == own:
                    inside = True
                    break
            if inside:
                best = other
        return best

    def missing(self, pt: Point) -> Verdict:
        return Verdict("unknown", "unknown", "missing-ranks", pt.items + [item(
            "missing", f"seen on ranks {self.ranks(pt.procs)} only, of a TP group of {self.group_size}")])
