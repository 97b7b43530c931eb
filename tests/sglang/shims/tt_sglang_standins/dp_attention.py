"""DP attention on the torch_native attention backend (facts: BEYOND-LLAMA.md, item 4).

With ``--enable-dp-attention`` SGLang's ForwardBatch asks the attention backend which value pads
the sequence lengths of an idle or padded DP batch (``get_cpu_graph_seq_len_fill_value``);
TorchNativeAttnBackend has no such method (``AttributeError``). A padded sequence of length 1,
the value SGLang's other CPU backends use, reads one cache slot and changes no real token.
"""

from __future__ import annotations


def _fill_value(self) -> int:
    return 1


def _patch_backend(module) -> None:
    cls = module.TorchNativeAttnBackend
    if not hasattr(cls, "get_cpu_graph_seq_len_fill_value"):
        cls.get_cpu_graph_seq_len_fill_value = _fill_value


PATCHES = {"sglang.srt.layers.attention.torch_native_backend": _patch_backend}
