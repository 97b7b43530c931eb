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

from tensor_trace.exporters.analysis.verdicts import compute_verdicts, inferred_tp_ranks, tp_groups

__all__ = ["compute_verdicts", "inferred_tp_ranks", "tp_groups"]
