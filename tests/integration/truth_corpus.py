"""The truth of the truth corpus: each point's placement, reduction, local shape and dtype, and
each module's collectives, derived from the TP plan a program was parallelised with and from
what each ParallelStyle does (its documented semantics), never from tensor-trace's output.

The definitions are those of shared/design.md, "Placement and reduction", applied to the LOCAL
tensor each rank holds (a DTensor is judged on its local tensor):
- a module whose call issues the sum-reduction and returns its result (RowwiseParallel, whose
  forward hook all-reduces or reduce-scatters the partial sums) is ``post-reduction``; so is that
  tensor wherever it is passed on unchanged (the next module's input);
- a column-parallel output is ``shard(last dim)``/``no-reduction``; an all-gathered output, a
  norm of a reduced tensor, an elementwise product of shards, a residual add ``x + attn(x)`` are
  ``no-reduction``;
- RowwiseParallel(output_layouts=Shard(1)) gives ``shard(1)``/``post-reduction``;
  SequenceParallel norms give ``shard(1)``/``no-reduction``;
- token ids, positions, masks and rotary tables are the same on every rank:
  ``replicate``/``no-reduction``.
No point here is ``partial``: the plans reduce inside the module call that makes the partial sum,
so no partial sum crosses a module boundary.

A walk per program (``titan_truth``, ``hf_llama_truth``) follows the model's forward as its source
is written and threads a ``PlannedTensor`` through each module, applying the module's style. Where
a point's existence depends on library internals that a plan does not fix (HF's attention mask:
4.57 passes a bool mask, 5.18 None), the point is ``optional``: compared only when the untraced run
saw it. No point is left out: test_truth_corpus.py fails on a point the untraced run has and the
truth does not state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REP, NO, POST = "replicate", "no-reduction", "post-reduction"


def shard(dim: int) -> str:
    return f"shard({dim})"


def shard_dim(placement: str):
    m = re.fullmatch(r"shard\((-?\d+)\)", placement)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor as the plan fixes it, on each rank: placement, reduction, local shape, dtype,
    and for a post-reduction tensor the family of the sum-reduction that produced it."""

    placement: str
    reduction: str
    shape: tuple
    dtype: str = "float32"
    collective: str | None = None
    optional: bool = False

    def local_op(self, shape=None) -> "PlannedTensor":
        """Computed locally from this tensor (a norm, an activation, a product with a tensor of
        the same placement): same placement, no reduction."""
        return PlannedTensor(self.placement, NO, tuple(shape or self.shape), self.dtype)


@dataclass(frozen=True)
class Style:
    """A ParallelStyle reduced to what decides placements.

    kind: ``colwise`` | ``rowwise`` | ``sequence`` | ``prepare_input``; ``output``: the output
    layout (``replicate`` or ``shard(D)``, D may be negative) of colwise/rowwise; ``inputs``:
    prepare_input's desired layout per positional input (None: left alone); ``seq_dim``: the
    sequence dim of SequenceParallel."""

    kind: str
    output: str | None = None
    inputs: tuple = ()
    seq_dim: int = 1


def _layout_name(p) -> str | None:
    """'replicate' / 'shard(D)' for a torch Placement (or None)."""
    if p is None:
        return None
    if type(p).__name__ == "Replicate":
        return REP
    if type(p).__name__ in ("Shard", "_StridedShard"):
        return shard(p.dim)
    raise ValueError(f"no truth for placement {p!r}")


def from_torch_style(style) -> Style:
    """Style of a torch.distributed.tensor.parallel ParallelStyle instance, read from its own
    attributes (so a plan written with other arguments gets its own truth)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if isinstance(style, ColwiseParallel):
        return Style("colwise", _layout_name(style.output_layouts[0]))
    if isinstance(style, RowwiseParallel):
        return Style("rowwise", _layout_name(style.output_layouts[0]))
    if isinstance(style, SequenceParallel):
        return Style("sequence", seq_dim=style.sequence_sharding[0].dim)
    if isinstance(style, PrepareModuleInput):
        return Style("prepare_input", inputs=tuple(_layout_name(p) for p in style.desired_input_layouts))
    raise ValueError(f"no truth for ParallelStyle {type(style).__name__}: add its semantics")


# transformers' style names (ParallelInterface in integrations/tensor_parallel.py for 4.x,
# distributed/tensor_parallel.py for 5.x): "colwise" is ColwiseParallel (output Shard(-1), kept
# local); "colwise_rep" / "colwise_gather_output" gather it (output Replicate()); "rowwise" is
# RowwiseParallel (output Replicate(): the partial sums are all-reduced inside the module call);
# "embedding_rowwise" is a vocab-parallel embedding reduced the same way; "rowwise_split_input"
# takes a replicated input and slices this rank's features off it inside the call (no
# collective), then reduces as "rowwise" does.
HF_STYLES = {"colwise": Style("colwise", shard(-1)), "colwise_rep": Style("colwise", REP),
             "colwise_gather_output": Style("colwise", REP), "rowwise": Style("rowwise", REP),
             "embedding_rowwise": Style("rowwise", REP),
             "rowwise_split_input": Style("rowwise", REP, inputs=(REP,)),
             # replicated weights; a forward does nothing to activations (its all-reduce is of
             # the weights' gradients, in a backward)
             "replicated_with_grad_allreduce": Style("replicate")}


def hf_plan_styles(plan: dict, module_paths) -> dict:
    """``{module path: Style}`` for the modules that a transformers TP plan (pattern -> name, a
    layer index written ``*``) names."""
    out = {}
    for path in module_paths:
        generic = re.sub(r"\.\d+(?=\.|$)", ".*", path)
        name = plan.get(generic)
        if name is None:
            continue
        if name not in HF_STYLES:
            raise ValueError(f"no truth for transformers TP style {name!r} ({path}): add its semantics")
        out[path] = HF_STYLES[name]
    return out


@dataclass
class Walk:
    """Threads tensors through modules under a plan; collects points and collectives."""

    styles: dict
    tp: int
    points: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)  # (module, family) -> count per step

    def put(self, name: str, t: PlannedTensor) -> PlannedTensor:
        self.points.setdefault(name, t)
        return t

    def _issue(self, module: str, family: str) -> None:
        key = (module, family)
        self.collectives[key] = self.collectives.get(key, 0) + 1

    def _norm_dim(self, placement: str, ndim: int) -> str:
        d = shard_dim(placement)
        return placement if d is None or d >= 0 else shard(d + ndim)

    def gather(self, module: str, t: PlannedTensor) -> PlannedTensor:
        """All-gather ``t`` along its shard dim (a redistribution Shard(D) -> Replicate)."""
        d = shard_dim(t.placement)
        if d is None:
            return t
        shape = list(t.shape)
        shape[d] *= self.tp
        self._issue(module, "all_gather")
        return PlannedTensor(REP, NO, tuple(shape), t.dtype)

    def _finish_colwise(self, path: str, local: PlannedTensor, style: Style) -> PlannedTensor:
        out = self._norm_dim(style.output, len(local.shape))
        if out == local.placement:
            return local
        if out == REP:
            return self.gather(path, local)
        raise ValueError(f"{path}: no truth for a colwise output {style.output}")

    def _finish_rowwise(self, path: str, full_shape: tuple, style: Style) -> PlannedTensor:
        out = self._norm_dim(style.output, len(full_shape))
        if out == REP:
            self._issue(path, "all_reduce")
            return PlannedTensor(REP, POST, tuple(full_shape), collective="all_reduce")
        d = shard_dim(out)
        shape = list(full_shape)
        shape[d] //= self.tp
        self._issue(path, "reduce_scatter")
        return PlannedTensor(out, POST, tuple(shape), collective="reduce_scatter")

    def linear(self, path: str, x: PlannedTensor, out_features: int) -> PlannedTensor:
        """An nn.Linear (bias or not) at ``path``: its input and output points."""
        self.put(f"{path}:input.0", x)
        style = self.styles.get(path)
        last = len(x.shape) - 1
        if style is None:
            assert shard_dim(x.placement) != last, f"{path}: a replicated linear of a last-dim shard"
            return self.put(f"{path}:output", x.local_op(x.shape[:-1] + (out_features,)))
        if style.kind == "colwise":
            xin = self.gather(path, x)
            local = PlannedTensor(shard(last), NO, xin.shape[:-1] + (out_features // self.tp,))
            return self.put(f"{path}:output", self._finish_colwise(path, local, style))
        if style.kind == "rowwise":
            if style.inputs == (REP,):  # (rowwise_split_input: the call slices it)
                assert x.placement == REP, f"{path}: rowwise_split_input's input must be replicated"
            else:
                assert shard_dim(x.placement) == last, f"{path}: rowwise input must be a last-dim shard"
            return self.put(f"{path}:output", self._finish_rowwise(path, x.shape[:-1] + (out_features,), style))
        raise ValueError(f"{path}: no truth for {style.kind} on a linear")

    def embedding(self, path: str, ids: PlannedTensor, dim: int) -> PlannedTensor:
        """An nn.Embedding at ``path`` (ids replicated): its input and output points."""
        self.put(f"{path}:input.0", ids)
        style = self.styles.get(path)
        full = ids.shape + (dim,)
        if style is None:
            return self.put(f"{path}:output", PlannedTensor(REP, NO, full))
        if style.kind == "colwise":  # embedding dim sharded: each rank looks up its columns
            local = PlannedTensor(shard(len(full) - 1), NO, ids.shape + (dim // self.tp,))
            return self.put(f"{path}:output", self._finish_colwise(path, local, style))
        if style.kind == "rowwise":  # vocab sharded: masked lookups are partial sums
            return self.put(f"{path}:output", self._finish_rowwise(path, full, style))
        raise ValueError(f"{path}: no truth for {style.kind} on an embedding")

    def norm(self, path: str, x: PlannedTensor) -> PlannedTensor:
        """A norm over the last dim at ``path`` (RMSNorm): same placement, no reduction."""
        self.put(f"{path}:input.0", x)
        style = self.styles.get(path)
        if style is not None and style.kind != "replicate":
            assert style.kind == "sequence", f"{path}: no truth for {style.kind} on a norm"
            assert x.placement == shard(style.seq_dim), f"{path}: SequenceParallel input is {x.placement}"
        return self.put(f"{path}:output", x.local_op())

    def enter(self, path: str, args: list) -> list:
        """The module at ``path`` is called with ``args`` (recorded as ``input.N``, as the caller
        passes them); what its forward sees once its style's input hook ran."""
        for i, a in enumerate(args):
            if a is not None:
                self.put(f"{path}:input.{i}", a)
        style = self.styles.get(path)
        if style is None:
            return list(args)
        assert style.kind == "prepare_input", f"{path}: no truth for {style.kind} on a container"
        inner = []
        for a, want in zip(args, style.inputs + (None,) * len(args)):
            inner.append(self.gather(path, a) if want == REP and a is not None else a)
        return inner


def heads_view(t: PlannedTensor, head_dim: int) -> PlannedTensor:
    """``t.view(*t.shape[:-1], -1, head_dim)``: a last-dim shard becomes a shard of the heads dim."""
    shape = t.shape[:-1] + (t.shape[-1] // head_dim, head_dim)
    placement = shard(len(shape) - 2) if shard_dim(t.placement) in (len(t.shape) - 1, -1) else t.placement
    return PlannedTensor(placement, t.reduction, shape, t.dtype)


def add(a: PlannedTensor, b: PlannedTensor) -> PlannedTensor:
    """``a + b`` (a residual add): computed locally, so no-reduction, whatever a and b were."""
    assert a.placement == b.placement and a.shape == b.shape, (a, b)
    return a.local_op()


def titan_truth(plan: str, tp: int, *, plan_styles, sizes: dict) -> Walk:
    """Truth for tests/integration/scripts/tp_api_llama.py under ``plan`` at TP ``tp``.

    ``plan_styles`` is that script's own function (module path -> ParallelStyle instance), so the
    truth follows the plan the program applies; the walk follows Transformer.forward."""
    w = Walk({p: from_torch_style(s) for p, s in plan_styles(plan, sizes["layers"]).items()}, tp)
    b, s, d = sizes["batch"], sizes["seq"], sizes["dim"]
    hd = d // sizes["heads"]
    tokens = w.put(":input.0", PlannedTensor(REP, NO, (b, s), "int64"))
    h = w.embedding("tok_embeddings", tokens, d)
    freqs = PlannedTensor(REP, NO, (s, hd // 2), "complex64")  # a buffer, identical on every rank
    for i in range(sizes["layers"]):
        p = f"layers.{i}"
        x, _ = w.enter(p, [h, freqs])
        n = w.norm(f"{p}.attention_norm", x)
        xa, fa = w.enter(f"{p}.attention", [n, freqs])
        q = w.linear(f"{p}.attention.wq", xa, sizes["heads"] * hd)
        w.linear(f"{p}.attention.wk", xa, sizes["kv_heads"] * hd)
        w.linear(f"{p}.attention.wv", xa, sizes["kv_heads"] * hd)
        o = q.local_op()  # attention over this rank's heads, heads flattened back: as q
        a = w.put(f"{p}.attention:output", w.linear(f"{p}.attention.wo", o, d))
        h1 = add(x, a)
        n2 = w.norm(f"{p}.ffn_norm", h1)
        (xf,) = w.enter(f"{p}.feed_forward", [n2])
        g = w.linear(f"{p}.feed_forward.w1", xf, sizes["hidden"])
        w.linear(f"{p}.feed_forward.w3", xf, sizes["hidden"])
        f = w.put(f"{p}.feed_forward:output", w.linear(f"{p}.feed_forward.w2", g.local_op(), d))
        h = w.put(f"{p}:output", add(h1, f))
    logits = w.linear("output", w.norm("norm", h), sizes["vocab"])
    w.put(":output", logits)
    return w


def hf_llama_truth(plan: dict, tp: int, *, sizes: dict, batch: int, seq: int, version: str,
                   moe: bool = False, post_norms: bool = False, head_norms: bool = False,
                   packed: bool = False) -> Walk:
    """Truth for tests/integration/scripts/tp_hf_llama.py: transformers' LlamaForCausalLM loaded
    with ``tp_plan="auto"``, whose applied plan (``model.tp_plan``) is ``plan``. The walk follows
    LlamaForCausalLM / LlamaModel / LlamaDecoderLayer.forward of transformers ``version`` (the
    4.x and 5.x sources differ in which keyword arguments they pass). ``moe``: tp_hf_mixtral.py's
    MixtralForCausalLM, the same walk but for its MLP (``hf_moe_mlp``). ``post_norms``:
    tp_hf_olmo2.py's Olmo2ForCausalLM (Olmo2DecoderLayer.forward of 5.x): no input norm; the
    attention's q and k projections each go through a norm over their whole width (q_norm,
    k_norm); the attention's and the MLP's outputs are normed (post_attention_layernorm,
    post_feedforward_layernorm) before each residual add. ``head_norms``: tp_hf_qwen3.py's
    Qwen3ForCausalLM (Qwen3Attention.forward of 5.x): q and k are viewed as
    ``[batch, seq, heads, head_dim]`` and each normed per head (q_norm, k_norm) on the heads the
    rank holds: a shard of the heads dim, which the view makes dim 2. ``packed``: tp_hf_phi3.py's
    Phi3ForCausalLM (Phi3DecoderLayer.forward of 5.x): one qkv_proj and one gate_up_proj
    (``hf_packed_attention``, ``hf_packed_mlp``), and each sublayer's output passed through a
    dropout module (an identity in eval) before its residual add."""
    major = int(version.split(".")[0])
    layers = sizes["num_hidden_layers"]
    paths = ["model.embed_tokens", "lm_head"]
    for i in range(layers):
        paths += [f"model.layers.{i}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")]
        if not moe:
            paths += [f"model.layers.{i}.mlp.{n}" for n in ("gate_proj", "up_proj", "gate_up_proj", "down_proj")]
    w = Walk(hf_plan_styles(plan, paths), tp)
    d, heads, kv = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    hd = sizes.get("head_dim") or d // heads
    ids = PlannedTensor(REP, NO, (batch, seq), "int64")
    w.put(":input.input_ids", ids)
    w.put("model:input.input_ids", ids)
    h = w.embedding("model.embed_tokens", ids, d)
    position_ids = PlannedTensor(REP, NO, (1, seq), "int64")
    if major >= 5 and not head_norms:  # (Qwen3Model passes position_ids by position)
        w.enter("model.rotary_emb", [h])
        w.put("model.rotary_emb:input.position_ids", position_ids)
    else:
        w.enter("model.rotary_emb", [h, position_ids])
    cos = w.put("model.rotary_emb:output.0", PlannedTensor(REP, NO, (1, seq, hd)))
    sin = w.put("model.rotary_emb:output.1", PlannedTensor(REP, NO, (1, seq, hd)))
    # The causal mask: built the same on every rank; whether it is materialised (or left to the
    # attention kernel's is_causal) is transformers' choice, not the plan's.
    mask = PlannedTensor(REP, NO, (batch, 1, seq, seq), "bool", optional=True)
    extras = {"attention_mask": mask, "position_ids": position_ids,
              "position_embeddings.0": cos, "position_embeddings.1": sin}
    if major < 5:
        extras["cache_position"] = PlannedTensor(REP, NO, (seq,), "int64")
    for i in range(layers):
        p = f"model.layers.{i}"
        (x,) = w.enter(p, [h])
        for k, v in extras.items():
            w.put(f"{p}:input.{k}", v)
        n = x if post_norms else w.norm(f"{p}.input_layernorm", x)
        w.put(f"{p}.self_attn:input.hidden_states", n)
        for k, v in extras.items():
            w.put(f"{p}.self_attn:input.{k}", v)
        if packed:
            a = w.put(f"{p}.self_attn:output.0", hf_packed_attention(w, f"{p}.self_attn", n, heads, kv, hd, d))
            a = dropout(w, f"{p}.resid_attn_dropout", a)
        else:
            q = w.linear(f"{p}.self_attn.q_proj", n, heads * hd)
            k_ = w.linear(f"{p}.self_attn.k_proj", n, kv * hd)
            if post_norms:
                q = w.norm(f"{p}.self_attn.q_norm", q)
                w.norm(f"{p}.self_attn.k_norm", k_)
            if head_norms:
                for name, t in (("q_norm", q), ("k_norm", k_)):
                    w.norm(f"{p}.self_attn.{name}", heads_view(t, hd))
            w.linear(f"{p}.self_attn.v_proj", n, kv * hd)
            # (the attention's output has q's placement: its heads are split as q's features are)
            a = w.put(f"{p}.self_attn:output.0", w.linear(f"{p}.self_attn.o_proj", q.local_op(), d))
        if post_norms:
            h1 = add(x, w.norm(f"{p}.post_attention_layernorm", a))
            (xm,) = w.enter(f"{p}.mlp", [h1])
        else:
            h1 = add(x, a)
            n2 = w.norm(f"{p}.post_attention_layernorm", h1)
            (xm,) = w.enter(f"{p}.mlp", [n2])
        if moe:
            f = hf_moe_mlp(w, plan, f"{p}.mlp", xm, sizes)
        elif packed:
            f = dropout(w, f"{p}.resid_mlp_dropout", hf_packed_mlp(w, f"{p}.mlp", xm, sizes["intermediate_size"], d))
        else:
            g = w.linear(f"{p}.mlp.gate_proj", xm, sizes["intermediate_size"])
            w.enter(f"{p}.mlp.act_fn", [g])
            act = w.put(f"{p}.mlp.act_fn:output", g.local_op())
            w.linear(f"{p}.mlp.up_proj", xm, sizes["intermediate_size"])
            f = w.put(f"{p}.mlp:output", w.linear(f"{p}.mlp.down_proj", act.local_op(), d))
        if post_norms:
            f = w.norm(f"{p}.post_feedforward_layernorm", f)
        h = w.put(f"{p}:output", add(h1, f))
    last = w.put("model:output.last_hidden_state", w.norm("model.norm", h))
    w.put(":output.logits", w.linear("lm_head", last, sizes["vocab_size"]))
    return w


def hf_packed_attention(w: Walk, path: str, n: PlannedTensor, heads: int, kv: int, hd: int, d: int) -> PlannedTensor:
    """Phi3Attention: q, k and v sliced out of one qkv_proj; o_proj of the attention's output,
    which has q's placement and q's width."""
    qkv = w.linear(f"{path}.qkv_proj", n, (heads + 2 * kv) * hd)
    width = heads * hd if qkv.placement == REP else heads * hd // w.tp
    return w.linear(f"{path}.o_proj", qkv.local_op(qkv.shape[:-1] + (width,)), d)


def hf_packed_mlp(w: Walk, path: str, xm: PlannedTensor, inter: int, d: int) -> PlannedTensor:
    """Phi3MLP: gate and up chunked out of one gate_up_proj, ``up * activation_fn(gate)``, then
    down_proj."""
    gu = w.linear(f"{path}.gate_up_proj", xm, 2 * inter)
    half = gu.local_op(gu.shape[:-1] + (gu.shape[-1] // 2,))
    w.enter(f"{path}.activation_fn", [half])
    act = w.put(f"{path}.activation_fn:output", half.local_op())
    return w.put(f"{path}:output", w.linear(f"{path}.down_proj", act.local_op(), d))


def dropout(w: Walk, path: str, t: PlannedTensor) -> PlannedTensor:
    """A dropout module in eval: its output is its input, carried unchanged."""
    w.enter(path, [t])
    return w.put(f"{path}:output", t)


# transformers 5's MoE styles (distributed/tensor_parallel.py): "packed_colwise" splits the stacked
# [E, 2I, H] gate_up_proj along dim 1 per half (_StridedShard(dim=1, sf=2): each rank holds
# [gate_r; up_r]), "rowwise" the [E, H, I] down_proj along dim 2, and "moe_tp_experts" runs the
# experts' forward on local tensors, then all-reduces its output inside the experts' call.
HF_MOE_STYLES = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise",
                 "experts.down_proj": "rowwise"}


def hf_moe_mlp(w: Walk, plan: dict, path: str, xm: PlannedTensor, sizes: dict) -> PlannedTensor:
    """MixtralSparseMoeBlock.forward at ``path`` (input ``xm``, [B, S, H]) under HF_MOE_STYLES:
    the router (``gate``, not in the plan) runs on every rank alike; the experts' forward
    (integrations/moe.py, grouped or batched) multiplies each of the T*k selected rows by its
    expert's local gate_up_proj, so ``chunk(2, dim=-1)`` hands ``act_fn`` this rank's slice of
    the gate: [T*k, I/tp] shard(1); down_proj's local product is a partial sum, all-reduced before
    the experts' call returns (post-reduction), and the block's reshape passes it on."""
    generic = re.sub(r"\.\d+(?=\.|$)", ".*", path)
    for sub, style in HF_MOE_STYLES.items():
        if plan.get(f"{generic}.{sub}") != style:
            raise ValueError(f"no truth for {path}.{sub} styled {plan.get(f'{generic}.{sub}')!r}: add its semantics")
    h, e, k = sizes["hidden_size"], sizes["num_local_experts"], sizes["num_experts_per_tok"]
    tokens = xm.shape[0] * xm.shape[1]
    flat = xm.local_op((tokens, h))  # hidden_states.view(-1, H)
    w.put(f"{path}.gate:input.0", flat)
    w.put(f"{path}.gate:output.0", PlannedTensor(REP, NO, (tokens, e)))  # router logits
    weights = w.put(f"{path}.gate:output.1", PlannedTensor(REP, NO, (tokens, k)))
    index = w.put(f"{path}.gate:output.2", PlannedTensor(REP, NO, (tokens, k), "int64"))
    w.enter(f"{path}.experts", [flat, index, weights])
    gate = w.put(f"{path}.experts.act_fn:input.0",
                 PlannedTensor(shard(1), NO, (tokens * k, sizes["intermediate_size"] // w.tp)))
    w.put(f"{path}.experts.act_fn:output", gate.local_op())
    w._issue(f"{path}.experts", "all_reduce")
    w.put(f"{path}.experts:output", PlannedTensor(REP, POST, (tokens, h), collective="all_reduce"))
    return w.put(f"{path}:output", PlannedTensor(REP, POST, xm.shape, collective="all_reduce"))
