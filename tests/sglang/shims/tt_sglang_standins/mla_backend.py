"""DeepSeek-V2/V3 (MLA) with SGLang's ``torch_native`` attention backend.

SGLang 0.5.23's DeepSeek attention asks ``AttentionBackendRegistry`` how to run for the
configured backend; ``torch_native`` has no entry, so it falls back to the Triton handler, which
takes the MHA prefill path against the MLA latent KV cache and fails with ``RuntimeError:
Expected size for first two dimensions of batch2 tensor to be: [2, 32] but got: [2, 48].``
Registered here: a ``torch_native`` handler that always takes the absorbed MLA path
(``_dispatch_mla_subtype``), which the torch_native backend serves from the latent cache.
"""

from __future__ import annotations


def _register(handler_module) -> None:
    dispatch = handler_module._dispatch_mla_subtype

    def handle_attention_torch_native(attn, forward_batch):
        return dispatch(attn, forward_batch)

    handler_module.AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)


PATCHES = {"sglang.srt.models.deepseek_common.attention_backend_handler": _register}
