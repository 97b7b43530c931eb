"""One run recorded on several nodes: gather the node folders' rank files into one folder.

Each node of a multi-node run (``record --run-id ID`` on every node) may write into a folder of
its own; ``tensor-trace merge DIR_NODE0 DIR_NODE1 ...`` gathers their rank files into the first
folder (hard links where the file system allows, copies otherwise), so that the store, and every
query over ``--trace DIR_NODE0``, sees the whole run. Rank files are named ``HOST-PID.ttr``:
files of different nodes do not collide.
"""

from __future__ import annotations

import json
import os
import shutil

from tensor_trace import schema
from tensor_trace.errors import BadInput
from tensor_trace.exporters.store.reader import rank_files


def gather_nodes(target: str, others: list[str]) -> int:
    """Link or copy the rank files of ``others`` into ``target/ranks``; return how many were added.

    Refuses (BadInput) a folder that is missing or records another run than ``target``."""
    run_id = schema.read_run_id(target)
    for d in [target, *others]:
        if not os.path.isdir(d):
            raise BadInput(f"{d}: no such trace folder")
    for d in others:
        other_id = schema.read_run_id(d)
        if run_id is None:
            run_id = other_id
        elif other_id is not None and other_id != run_id:
            raise BadInput(f"{d} records run {other_id}, not {target}'s run {run_id}: "
                           f"record every node with the same --run-id")
    ranks = os.path.join(target, "ranks")
    os.makedirs(ranks, exist_ok=True)
    added = 0
    for d in others:
        if os.path.realpath(d) == os.path.realpath(target):
            continue
        for src in rank_files(d):
            dst = os.path.join(ranks, os.path.basename(src))
            if os.path.exists(dst):
                if os.path.samefile(src, dst) or os.path.getsize(src) == os.path.getsize(dst):
                    continue
                raise BadInput(f"{dst} exists and differs from {src}: two nodes wrote the same rank file name")
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            added += 1
    if schema.read_run_id(target) is None and run_id is not None:
        with open(os.path.join(target, "run.json"), "w") as f:
            json.dump(dict(run_id=run_id, gathered_from=others), f, indent=1)
    return added
