"""The analysis stage: placement and reduction verdicts for every capture point, from evidence.

- ``tolerance``: when two fingerprints describe the same values;
- ``step_view``: one step of one TP group, aligned across its ranks;
- ``evidence``: structured evidence items and the verdict they support;
- ``declared``: what DTensors and framework layer classes declare (extra evidence);
- ``rules``: one rule per kind of evidence, in order (the families in ``rules_reductions``,
  ``rules_declared``, ``rules_weights``, ``rules_dataflow`` and ``experts``);
- ``judge``: the rules applied to a step in execution order (placement propagates along it);
- ``verdicts``: sampled steps, the vote, the ``points`` table.
"""

import functools
import hashlib
import os

from tensor_trace.exporters.analysis.verdicts import compute_verdicts, inferred_tp_ranks, tp_groups

__all__ = ["compute_verdicts", "inferred_tp_ranks", "tp_groups", "version"]


@functools.lru_cache(maxsize=1)
def version() -> str:
    """This analysis' version: a digest of its source files (a rule changed in a patch release
    or a checkout changes it too), or, where they cannot be read, the package's version."""
    folder = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    read = 0
    try:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read() + b"\0")
                read += 1
    except OSError:
        read = 0
    if read:
        return h.hexdigest()[:16]
    # (an install of compiled files only: a digest of nothing would be the same for every release)
    from importlib import metadata

    try:
        return "package-" + metadata.version("tensor-trace")
    except metadata.PackageNotFoundError:
        return "unknown"
