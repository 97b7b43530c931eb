"""Compatibility names for code written against the first round's single placement module.

The verdict engine lives in ``tensor_trace.exporters.analysis``; import from there.
"""

from tensor_trace.exporters.analysis.step_view import (GATHER, REDUCE_SCATTER, REDUCING, SUM_OPS, WINDOW,  # noqa: F401
                                                       StepView, coll_desc, coll_json, point_name)
from tensor_trace.exporters.analysis.tolerance import (EPS, Observed as T, close, fp_equal, linked,  # noqa: F401
                                                       sum_tol)
from tensor_trace.exporters.analysis.verdicts import (compute_verdicts, inferred_tp_ranks,  # noqa: F401
                                                      sample_steps, tp_groups)
