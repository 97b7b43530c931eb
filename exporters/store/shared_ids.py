"""The ids all rank files of a store share (modules, layouts, groups), given out in first-seen
order across files in sorted order: the merge's loader (``loader``) and its workers
(``merge_workers``) give them, ``copy_part`` maps a worker's to the store's."""

from __future__ import annotations

import json

from tensor_trace.exporters.store.merge_align import text_code


class SharedIds:
    """Ids shared by all files of the store: modules, layouts, groups."""

    def __init__(self, con):
        self.con = con
        self.modules: dict = {}
        self.layouts: dict = {}
        self.signature_codes: list = []  # layout id -> text_code of its signature (shapes, dtypes)
        self.layout_base = 0  # the first layout id (shift_layouts)
        self.groups: dict = {}

    def module(self, path, cls):
        entry = self.modules.get(path)
        if entry is None:
            mid = len(self.modules)
            self.modules[path] = [mid, cls]
            return mid
        if cls and not entry[1]:
            entry[1] = cls
        return entry[0]

    def layout(self, slots):
        return self.layout_key(json.dumps(slots, separators=(",", ":")))

    def layout_key(self, key):
        lid = self.layouts.get(key)
        if lid is None:
            lid = len(self.layouts) + self.layout_base
            self.layouts[key] = lid
            self.signature_codes.append(text_code(_signature(key)))
        return lid

    def shift_layouts(self, k: int) -> None:
        """Number every layout ``k`` higher, and new ones from there: a merge worker's guess of the
        ids the store will give its layouts, so that its part can be copied as it is stored
        (merge_workers). They are labels that the copy maps by key: a wrong guess costs only
        that faster copy."""
        if k > 0:
            self.layouts = {key: lid + k for key, lid in self.layouts.items()}
            self.layout_base += k
            self.signature_codes[:0] = [-1] * k

    def group(self, name, ranks, backend, pg_name):
        key = (pg_name, json.dumps(ranks))
        entry = self.groups.get(key)
        if entry is None:
            entry = (len(self.groups), name, json.dumps(ranks), backend, pg_name)
            self.groups[key] = entry
        return entry[0]

    def write(self):
        con = self.con
        con.executemany("INSERT INTO modules VALUES (?,?,?)",
                        [(mid, path, cls) for path, (mid, cls) in self.modules.items()])
        con.executemany("INSERT INTO layouts VALUES (?,?,?)", [
            (lid, k, _signature(k)) for k, lid in self.layouts.items()])
        con.executemany("INSERT INTO groups VALUES (?,?,?,?,?)", list(self.groups.values()))


def _signature(layout_key: str) -> str:
    """A layout's shapes and dtypes (layouts.signature): its slots without names and devices."""
    return json.dumps([[s[1], s[2]] for s in json.loads(layout_key)], separators=(",", ":"))
