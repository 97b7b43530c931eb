"""What a framework's layer class declares of an output that is a sum (declared.residual_sum)."""

from tensor_trace.exporters.analysis.declared import residual_sum


def test_a_fused_add_norms_second_output_is_declared_a_residual_sum():
    assert "x + residual" in residual_sum({"sglang_class": "RMSNorm"}, "output.1", 2)
    assert residual_sum({"sglang_class": "RMSNorm"}, "output.0", 2) is None  # the norm itself
    assert residual_sum({"sglang_class": "RMSNorm"}, "output.1", 1) is None  # no residual given
    assert residual_sum({"sglang_class": "RowParallelLinear"}, "output.1", 2) is None
