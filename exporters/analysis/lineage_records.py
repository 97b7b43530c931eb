"""The store reads behind a lineage answer (lineage.py): one process's lineage records of one
step (ops, the slot sources of module calls, spans and their layouts), and the recorded output
of a step that a fingerprint matches, with what every resolver of one store shares.
"""

from __future__ import annotations

import json

from tensor_trace.format.fingerprints import decode_fingerprints
from tensor_trace.format.lineage_refs import with_step
from tensor_trace.format.points import is_output


def read_shared(con) -> tuple:
    """What every resolver of one store reads: module paths, points, a layout cache."""
    modules = dict(con.execute("SELECT module_id, path FROM modules"))
    points = {}
    for point, module, call, slot, placement, shapes, dtype in con.execute(
            "SELECT point, module, call, slot, placement, shapes, dtype FROM points"):
        points[(module, call, slot)] = dict(point=point, module=module, placement=placement,
                                            shapes={int(k): v for k, v in json.loads(shapes).items()},
                                            dtype=dtype)
    return modules, points, {}


class Resolver:
    """Reads one process's lineage records of one step and names what refs point at."""

    def __init__(self, con, proc: int, step: int, shared=None):
        self.con, self.proc, self.step = con, proc, step
        if shared is None:
            shared = read_shared(con)
        self.shared = shared
        self.modules, self.points, self.layouts = shared
        self._view = None
        self._steps = {step: self}

    def at_step(self, step) -> "Resolver":
        """The resolver of another step of this process (a ref into an earlier step: the
        target's step, for a draft step that consumes its captures)."""
        hit = self._steps.get(step)
        if hit is None:
            hit = self._steps[step] = Resolver(self.con, self.proc, step, self.shared)
            hit._steps = self._steps
        return hit

    def slots(self, layout_id) -> list:
        hit = self.layouts.get(layout_id)
        if hit is None:
            row = self.con.execute("SELECT slots FROM layouts WHERE layout_id=?", (layout_id,)).fetchone()
            hit = self.layouts[layout_id] = json.loads(row[0]) if row else []
        return hit

    def span(self, step, idx):
        # A step's spans are a rowid range (steps.span_first/last): no scan of the whole table.
        return self.con.execute(
            "SELECT s.module_id, s.call, s.layout_id FROM steps st JOIN spans s ON s.rowid BETWEEN "
            "st.span_first AND st.span_last WHERE st.proc=? AND st.step=? AND s.proc=st.proc AND s.step=st.step "
            "AND s.idx=? LIMIT 1", (self.proc, step, idx)).fetchone()

    def leaf(self, step, idx, slot_i) -> dict:
        row = self.span(step, idx)
        if row is None:
            return dict(point=f"<span {idx} of step {step}>", placement="unknown", shapes={}, dtype=None)
        mid, call, lay = row
        slots = self.slots(lay)
        slot = slots[slot_i][0] if slot_i < len(slots) else "?"
        module = self.modules.get(mid, "?")
        hit = self.points.get((module, call, slot))
        if hit is not None:
            return dict(hit)
        shape = slots[slot_i][1] if slot_i < len(slots) else None
        return dict(point=f"{module}:{slot}", module=module, placement="unknown",
                    shapes={0: shape} if shape else {}, dtype=slots[slot_i][2] if slot_i < len(slots) else None)

    def param(self, module, name) -> dict:
        """A module parameter that a node took as input (a ``REF_PARAM`` ref), as a leaf: its
        local shape per rank and the placement its DTensor declares, if it is one."""
        from tensor_trace.exporters.analysis.declared import dtensor_placement

        shapes, placement, dtype = {}, "unknown", None
        for rank, shape, pdtype, meta in self.con.execute(
                "SELECT pr.rank, p.shape, p.dtype, p.meta FROM params p JOIN modules m USING(module_id) "
                "JOIN processes pr ON pr.proc=p.proc WHERE m.path=? AND p.name=?", (module, name)):
            shape = json.loads(shape)
            shapes[rank if rank is not None else 0] = shape
            dtype = pdtype
            says = dtensor_placement(json.loads(meta) if meta else None, len(shape))
            if says is not None:
                placement = says
        return dict(point=f"{module}.{name}", module=module, placement=placement, shapes=shapes, dtype=dtype)

    def node(self, step, node):
        row = self.con.execute("SELECT op, attrs, inputs, shape FROM lineage WHERE proc=? AND step=? AND node=?",
                               (self.proc, step, node)).fetchone()
        if row is None:
            return None
        op, attrs, inputs, shape = row
        # A fingerprint index is one of the node's step: the step goes with it.
        inputs = [with_step(r, step) for r in json.loads(inputs)]
        return op, json.loads(attrs) if attrs else {}, inputs, json.loads(shape)

    def slot_src(self, step, span, slot_i):
        """The node ref a module call's slot was built by, if any (a SLOT_SRC record)."""
        row = self.con.execute("SELECT ref FROM slot_sources WHERE proc=? AND step=? AND span=? AND slot=?",
                               (self.proc, step, span, slot_i)).fetchone()
        return json.loads(row[0]) if row else None

    def view(self):
        """This process's view of the step (step_view.StepView) and its fingerprints by index."""
        from tensor_trace.exporters.analysis import step_view as sv

        if self._view is None:
            layouts = {lid: json.loads(s) for lid, s in self.con.execute("SELECT layout_id, slots FROM layouts")}
            rank_of = {p: (r if r is not None else 0) for p, r in self.con.execute("SELECT proc, rank FROM processes")}
            self._view = sv.StepView(self.con, self.step, [self.proc], layouts, self.modules, rank_of)
            self._fps = {}
            for first, data, indices in self.con.execute(
                    "SELECT first, data, indices FROM fingerprints WHERE proc=? AND step=?", (self.proc, self.step)):
                decode_fingerprints(first, data, indices, self._fps)
            for idx, s, q in self.con.execute("SELECT idx, sum, sumsq FROM wide_fingerprints WHERE proc=? AND step=?",
                                              (self.proc, self.step)):
                self._fps[idx] = (s, q)
        return self._view

    def by_values(self, fp_index, shape, before=None) -> dict | None:
        """The latest recorded output of this step (ending by ``before``, ns from the step's
        start, if given) whose fingerprint equals fingerprint ``fp_index``."""
        from tensor_trace.exporters.analysis import tolerance as tol

        view = self.view()
        fp = self._fps.get(fp_index)
        if fp is None:
            return None
        best = None
        for key, obs in view.points.items():
            t = obs.get(self.proc)
            if t is None or t.fp is None or not is_output(key[2]):
                continue
            probe = tol.Observed(shape, t.dtype, fp)
            if t.numel == probe.numel and tol.fp_equal(t, probe):
                order = view.times.get(key, (0, 0, 0))
                if before is not None and order[0] > before:
                    continue
                # The call entered last (highest span index) made it: outer modules that
                # pass the same tensor on entered earlier.
                if best is None or order[1] > best[0][1]:
                    best = (order, key)
        if best is None:
            return None
        module, call, slot = best[1]
        out = dict(self.points.get((module, call, slot)) or dict(point=f"{module}:{slot}", placement="unknown",
                                                                shapes={}, dtype=None))
        out["at"] = (self.step, best[0][1], best[0][2])  # (step, span, slot): where it was recorded
        return out
