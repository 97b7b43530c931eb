"""SGLang integration: collectives at GroupCoordinator, one step per model forward.

Collectives. On GPU, SGLang's all_reduce mostly bypasses torch.distributed (custom all-reduce,
quick all-reduce, PyNccl through ctypes, symmetric memory, ``torch.ops.sglang.*`` custom ops), so
only ``GroupCoordinator`` sees every path. Its public methods are wrapped on the class; while one
records, the tracer's ``in_collective`` flag makes the c10d wrappers pass the inner call through,
so no collective is counted twice. The span names the group by SGLang's own name (``tp``,
``attn_tp``, ``pp``, ...: the part of ``unique_name`` before the colon) and its global ranks.

Steps. ``ModelRunner.forward`` calls ``self.model.forward(...)`` directly, so the model's own
forward hooks never fire and its children would each look like an outermost module. The wrapper
makes one model forward one step, rooted at the model (so paths are SGLang's own names:
``model.embed_tokens``, ``model.layers.0.self_attn.qkv_proj``, ``lm_head``), tagged with the
forward mode, batch size and token count.

Everything here looks the tracer up at call time and passes straight through when none runs.
"""

from __future__ import annotations

import functools
import inspect

from tensor_trace.tracer import current
from tensor_trace.tracer.patching import wrap_method

# method -> (input argument names, output argument names, reduce op)
_GROUP_METHODS = {
    "all_reduce": (("input_",), (), "sum"),
    "reduce_scatter_tensor": (("input",), ("output",), "sum"),
    "reduce_scatter": (("input_list",), ("output",), "sum"),
    "reduce_scatterv": (("input_",), ("output",), "sum"),
    "reduce_scatter_along_dim": (("input_",), (), "sum"),
    "all_gather_into_tensor": (("input",), ("output",), None),
    "all_gather": (("input_",), ("output_tensor_list",), None),
    "all_gatherv": (("input_",), (), None),
    "all_to_all_single": (("input",), ("output",), None),
    "broadcast": (("input_",), (), None),
    "send": (("tensor",), (), None),
    "recv": ((), (), None),
}


def patch(name: str, module) -> None:
    if name == "sglang.srt.distributed.parallel_state":
        _patch_group_coordinator(module.GroupCoordinator)
    elif name == "sglang.srt.model_executor.model_runner":
        _patch_model_runner(module.ModelRunner)
        _patch_forward_batch(_register_context(module))
    elif name in ("sglang.srt.model_executor.runner.decode_cuda_graph_runner",
                  "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"):
        for value in vars(module).values():
            if isinstance(value, type) and "capture_one_shape" in value.__dict__:
                patch_graph_capture(value, "decode" if "decode" in name else "extend")
    elif name == "sglang.srt.layers.aux_hidden_states":
        for cls_name in ("AuxHiddenStateList", "AuxHiddenStatePacker"):
            cls = getattr(module, cls_name, None)
            if cls is not None:
                _patch_aux_capture(cls)


_LAYER = None


def patch_graph_capture(cls, mode: str) -> None:
    """SGLang's graph runners call ``model.forward`` themselves (warm-up runs, then the run under
    ``torch.cuda.graph``), outside ``ModelRunner.forward``: each call becomes a step of its own,
    rooted at the model so paths keep SGLang's names. The step run under capture is marked
    captured, and its fingerprint kernels go into the graph; each replay (inside a later
    ``ModelRunner.forward`` step) then carries that step's spans with fresh values
    (tracer/cuda_graphs.py)."""
    wrap_method(cls, "capture_one_shape", lambda orig: _capture_one_shape(orig, mode))


def _capture_one_shape(orig, mode):
    def capture_one_shape(self, size, forward, *args, **kwargs):
        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        if current() is None or model is None:
            return orig(self, size, forward, *args, **kwargs)

        @functools.wraps(forward)
        def traced_forward(*fargs, **fkwargs):
            tr = current()
            if tr is None or not tr.enabled or tr.in_step:
                return forward(*fargs, **fkwargs)
            if "tp_rank" not in tr.identity:
                _record_tp_identity(tr)
            attrs = {"forward_mode": mode, "batch_size": int(size), "cuda_graph": "capture"}
            return tr.run_external_step(model, fargs, attrs, forward, *fargs, **fkwargs)

        return orig(self, size, traced_forward, *args, **kwargs)

    return capture_one_shape


def _patch_aux_capture(cls) -> None:
    """EAGLE-3 aux hidden states as named points ``capture:eagle3.aux.K``.

    SGLang's Llama passes ``capture`` to decoder layer i for each i in ``layers_to_capture``
    (``[id + 1 for id in eagle3 layer ids]``); the layer captures the residual stream entering
    it, i.e. the hidden state after layer i-1 (the embedding output for i = 0). K counts the
    captures of the step in order, which is the order the draft model concatenates them in.
    """
    wrap_method(cls, "capture", _aux_capture)


def _aux_capture(orig):
    def capture(self, hidden, *args, **kwargs):
        tr = current()
        if tr is not None and tr.tracing_step:
            try:
                k = len(self) if isinstance(self, list) else getattr(self, "_idx", 0)
                tr.record_capture(f"eagle3.aux.{k}", hidden, _capture_info(tr))
            except Exception as exc:
                tr.on_error("eagle3 aux capture", exc)
        return orig(self, hidden, *args, **kwargs)

    return capture


def _capture_info(tr) -> dict:
    global _LAYER
    import re

    if _LAYER is None:
        _LAYER = re.compile(r"(.*\.)?layers\.(\d+)")
    layer = tr.enclosing_module(_LAYER)
    if layer is None:
        return {"kind": "eagle3 aux hidden state"}
    i = int(layer.rsplit(".", 1)[1])
    before = f"{layer.rsplit('.', 1)[0]}.{i - 1}" if i > 0 else "the embedding"
    return {"kind": "eagle3 aux hidden state", "layer": layer, "eagle3_layer_id": i - 1,
            "what": f"residual stream entering {layer} (the hidden state after {before})"}


def group_name(gc) -> str:
    return str(getattr(gc, "unique_name", "group")).split(":")[0]


def _patch_group_coordinator(cls) -> None:
    for method, (in_args, out_args, reduce_op) in _GROUP_METHODS.items():
        wrap_method(cls, method, functools.partial(_wrap_group_method, method, in_args=in_args,
                                                   out_args=out_args, reduce_op=reduce_op))


def _wrap_group_method(method, orig, in_args, out_args, reduce_op):
    # not at the top: SGLang modules imported before torch import this one
    from tensor_trace.tracer.functional import tensors_of

    signature = inspect.signature(orig)

    def wrapper(self, *args, **kwargs):
        tr = current()
        if (tr is None or not tr.enabled or tr.in_collective or tr.busy or tr.collectives is None
                or getattr(self, "world_size", 1) == 1):
            return orig(self, *args, **kwargs)
        ic = tr.collectives
        token = None
        bound = None
        try:
            key = f"sglang:{getattr(self, 'unique_name', id(self))}"
            group_seq = ic.seq_for(key, group_name(self), list(getattr(self, "ranks", [])),
                                   "sglang", str(getattr(self, "unique_name", "")))
            if tr.tracing_step:  # (the arguments bound only for a call that is recorded)
                bound = signature.bind(self, *args, **kwargs).arguments
                inputs = [t for a in in_args for t in tensors_of(bound.get(a))]
                token = ic.begin(method, reduce_op, group_seq, inputs, False)
        except Exception as exc:
            tr.on_error(f"GroupCoordinator.{method}", exc)
            token = None
        result = ic.call(token, orig, (self, *args), kwargs)
        if token is not None:
            outputs = [t for a in out_args for t in tensors_of(bound.get(a))] + tensors_of(result)
            token.append(outputs)
            ic.finish(token)
        return result

    return wrapper


def _patch_model_runner(cls) -> None:
    wrap_method(cls, "forward", _model_runner_forward)


def _model_runner_forward(orig):
    def forward(self, forward_batch, *args, **kwargs):
        tr = current()
        model = getattr(self, "model", None)
        if tr is None or not tr.enabled or tr.in_step or model is None:
            return orig(self, forward_batch, *args, **kwargs)
        if "tp_rank" not in tr.identity:
            _record_tp_identity(tr)
        attrs = _step_attrs(forward_batch)
        # Which model ran: an EAGLE draft and its target share the forward modes (extend,
        # decode), so a step says whose forward it was.
        attrs["model"] = type(model).__name__
        if getattr(self, "is_draft_worker", False):
            attrs["draft"] = True
        return tr.run_external_step(model, (forward_batch,), attrs, orig, self, forward_batch, *args, **kwargs)

    return forward


def _record_tp_identity(tr) -> None:
    """This worker's TP group as SGLang built it (rank in group, size, global ranks), and its
    other parallel groups (``groups``: attention TP/CP/DP, MoE EP/TP/DP, PP), so the analysis
    can judge each point across the ranks that hold the same data."""
    try:
        from sglang.srt.distributed import get_tp_group

        g = get_tp_group()
        extra = {}
        groups = parallel_groups()
        if groups:
            extra["groups"] = groups
            extra["dp_attention"] = groups.get("attn_dp", {}).get("size", 1) > 1
        tr.update_identity(tp_rank=g.rank_in_group, tp_size=g.world_size, tp_ranks=list(g.ranks),
                           tp_group="tp", **extra)
    except Exception as exc:
        tr.on_error("sglang tp identity", exc)


# SGLang's GroupCoordinators (runtime_context.ParallelContext attributes), by the name the trace uses
_GROUP_ATTRS = (("tp", "tp_group"), ("attn_tp", "attn_tp_group"), ("attn_cp", "attn_cp_group"),
                ("moe_ep", "moe_ep_group"), ("moe_tp", "moe_tp_group"), ("moe_dp", "moe_dp_group"),
                ("pp", "pp_group"))


def parallel_groups() -> dict:
    """``{name: {"size", "rank", "ranks"}}`` of SGLang's parallel groups in this process (global
    ranks, this rank's index in the group). Attention DP is no GroupCoordinator: its ranks are
    those of the TP group at the same attention-TP and -CP position (SGLang's layout is
    (dp, cp, tp), tp fastest: ``runtime_context.derive_attention_ranks``)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
    except Exception:
        return {}
    out = {}
    for name, attr in _GROUP_ATTRS:
        try:
            gc = getattr(par, attr)
            out[name] = dict(size=int(gc.world_size), rank=int(gc.rank_in_group), ranks=list(gc.ranks))
        except Exception:
            continue
    try:
        dp, tp = int(par.attn_dp_size or 1), out.get("tp")
        a_tp, a_cp = out.get("attn_tp", {}).get("size", 1), out.get("attn_cp", {}).get("size", 1)
        if tp and dp * a_tp * a_cp == tp["size"]:
            offset = tp["rank"] % (a_tp * a_cp)
            out["attn_dp"] = dict(size=dp, rank=int(par.attn_dp_rank),
                                  ranks=[tp["ranks"][k * a_tp * a_cp + offset] for k in range(dp)])
    except Exception:
        pass
    return out


def _register_context(model_runner_module):
    """SGLang's ForwardBatch is the step's context: its tensors are recorded among the step
    root's inputs, not again in every layer and attention module it is passed to. Returns the
    class (None where it is not found)."""
    import sys

    from tensor_trace.tracer import tensor_slots

    info = sys.modules.get("sglang.srt.model_executor.forward_batch_info")
    cls = getattr(info, "ForwardBatch", None) or getattr(model_runner_module, "ForwardBatch", None)
    if isinstance(cls, type):
        tensor_slots.add_context_type(cls)
        return cls
    return None


def _patch_forward_batch(cls) -> None:
    if cls is not None:
        wrap_method(cls, "prepare_mlp_sync_batch", _prepare_mlp_sync_batch)


def _prepare_mlp_sync_batch(orig):
    """Under DP attention SGLang pads the batch inside the forward (``prepare_mlp_sync_batch``):
    in its MAX_LEN mode every DP rank runs as many rows as the longest, an idle one included,
    and gathers them with all_gather. The rows each DP rank then runs (``dp_rows``), this
    rank's rows and requests (``rows``, ``batch_rows``) and the mode (``dp_padding``) are added
    to the step, whose tokens were counted before the padding: without them a padded idle
    rank's rows look like nobody's."""
    def prepare(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        tr = current()
        if tr is not None and tr.tracing_step:
            try:
                tr.add_step_attrs(**_padded_rows(self))
            except Exception as exc:
                tr.on_error("sglang dp padding", exc)
        return result

    return prepare


def _padded_rows(forward_batch) -> dict:
    out = {_PADDED_NAMES[k]: v for k, v in _batch_counts(forward_batch).items()}
    mode = getattr(forward_batch, "dp_padding_mode", None)
    if mode is not None:
        out["dp_padding"] = str(getattr(mode, "name", mode)).lower()
    return out


# a batch's counts as the step began (_batch_counts's names) -> once SGLang padded it
_PADDED_NAMES = {"batch_size": "batch_rows", "tokens": "rows", "dp_tokens": "dp_rows"}


def _batch_counts(forward_batch) -> dict:
    """The batch's requests (``batch_size``), this rank's tokens (``tokens``) and, under DP
    attention, every DP rank's (``dp_tokens``: the split of the batch), as the batch holds them
    now (before or after SGLang pads it)."""
    out = {}
    bs = getattr(forward_batch, "batch_size", None)
    if isinstance(bs, int):
        out["batch_size"] = bs
    ids = getattr(forward_batch, "input_ids", None)
    if ids is not None and hasattr(ids, "numel"):
        out["tokens"] = int(ids.numel())
    dp_tokens = getattr(forward_batch, "global_num_tokens_cpu", None)
    if isinstance(dp_tokens, (list, tuple)) and len(dp_tokens) > 1:
        out["dp_tokens"] = [int(n) for n in dp_tokens]
    return out


_MAX_RIDS = 64  # request ids kept per step (a step's attrs stay small at any batch size)


def _step_attrs(forward_batch) -> dict:
    attrs = {}
    try:
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is not None:
            attrs["forward_mode"] = str(getattr(mode, "name", mode)).lower()
        attrs.update(_batch_counts(forward_batch))
        # For pairing steps across runs (tensor-trace compare): host-side values SGLang already
        # holds, read once per step, never per module call.
        seq_lens_sum = getattr(forward_batch, "seq_lens_sum", None)
        if isinstance(seq_lens_sum, int):
            attrs["seq_lens_sum"] = seq_lens_sum
        rids = getattr(forward_batch, "rids", None)
        if isinstance(rids, list) and rids:
            attrs["rids"] = [str(r) for r in rids[:_MAX_RIDS]]
    except Exception:
        pass
    return attrs


_PARALLEL_CLASSES = ("VocabParallelEmbedding", "ParallelLMHead", "ColumnParallelLinear",
                     "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
                     "ReplicatedLinear", "FusedMoE")
_ATTRS = ("gather_output", "reduce_results", "input_is_parallel", "parallel_group", "tp_size",
          "input_size_per_partition", "output_size_per_partition", "num_embeddings_per_partition",
          # FusedMoE (and its subclasses): how the experts are split across ranks. Expert
          # parallel gives each rank whole experts of its own (moe_ep), tensor parallel a slice
          # of every expert's intermediate dimension (moe_tp).
          "moe_tp_size", "moe_ep_size", "num_experts", "num_local_experts", "top_k",
          "intermediate_size_per_partition")


# SGLang's norms, which given a residual return (norm(x + residual), x + residual): their second
# output is a residual sum, whatever its values (dummy weights' layer outputs vanish in it).
# Those of its layers' module only: a model's own class of the same name need not add the
# residual (Command-R's LayerNorm returns it as it was given).
_NORM_CLASSES = ("RMSNorm", "GemmaRMSNorm", "LayerNorm")
_NORM_MODULE = "sglang.srt.layers.layernorm"


def module_attrs(module) -> dict | None:
    """SGLang's parallel layers: their class (the nearest known one in the MRO) and the
    attributes that decide their output's placement; SGLang's norms: their class."""
    known = next((c.__name__ for c in type(module).__mro__ if c.__name__ in _PARALLEL_CLASSES), None)
    if known is None:
        norm = next((c.__name__ for c in type(module).__mro__
                     if c.__name__ in _NORM_CLASSES and c.__module__ == _NORM_MODULE), None)
        return {"sglang_class": norm, "residual_sum_output": "output.1"} if norm else None
    out = {"sglang_class": known}
    for name in _ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, (bool, int, str)):
            out[name] = value
    group = getattr(module, "tp_group", None)  # the layer's own group (attention TP under DP attention)
    size = getattr(group, "world_size", None)
    if isinstance(size, int):
        out["group"], out["group_size"] = group_name(group), size
    return out
