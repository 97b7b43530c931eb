"""What a framework's layer class declares of an output that is a sum (declared.residual_sum)."""

from tensor_trace.exporters.analysis.declared import residual_sum


def test_a_fused_add_norms_second_output_is_declared_a_residual_sum():
    norm = {"sglang_class": "RMSNorm", "residual_sum_output": "output.1"}  # (integrations/sglang.py)
    assert "x + residual" in residual_sum(norm, "output.1", 2)
    assert residual_sum(norm, "output.0", 2) is None  # the norm itself
    assert residual_sum(norm, "output.1", 1) is None  # no residual given
    assert residual_sum({"sglang_class": "RowParallelLinear"}, "output.1", 2) is None


def test_the_sglang_integration_names_the_residual_sum_of_its_norms_only():
    import torch.nn as nn

    from tensor_trace.tracer.integrations.sglang import module_attrs

    class RMSNorm(nn.Module):
        pass

    RMSNorm.__module__ = "sglang.srt.layers.layernorm"
    assert module_attrs(RMSNorm())["residual_sum_output"] == "output.1"
    assert module_attrs(nn.LayerNorm(4)) is None  # torch's own: no residual argument


def test_a_models_own_norm_class_of_the_same_name_declares_nothing():
    """SGLang's Command-R defines its own ``LayerNorm`` in its model file, which returns the
    residual it was given unchanged (a held-out run, not written here: its ``output.1`` is the
    embedding's all_reduce output, post-reduction, and was called a residual sum); a subclass
    of SGLang's own norm still declares its sum."""
    import torch.nn as nn

    from tensor_trace.tracer.integrations.sglang import module_attrs

    class LayerNorm(nn.Module):
        pass

    LayerNorm.__module__ = "sglang.srt.models.commandr"
    assert module_attrs(LayerNorm()) is None

    class RMSNorm(nn.Module):
        pass

    RMSNorm.__module__ = "sglang.srt.layers.layernorm"

    class Qwen3NextRMSNorm(RMSNorm):
        pass

    Qwen3NextRMSNorm.__module__ = "sglang.srt.models.qwen3_next"
    assert module_attrs(Qwen3NextRMSNorm())["residual_sum_output"] == "output.1"
