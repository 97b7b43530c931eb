"""Tracer cost per module call for the call patterns of real models, side by side in one run.

    python bench/call_patterns.py [--rounds 9] [--steps 50] [--clock wall|thread] [--json PATH]
    TENSOR_TRACE_NATIVE=1 python bench/call_patterns.py ...   # tracer/native.py's keys and C call wrapper

Two 32-layer decode-step models whose modules do no work (each returns tensors it holds), so the
tracer's own cost per call is what is measured, with little noise:

- ``llama``   the module structure of bench/overhead.py's Llama (nn.Linear-style calls: one tensor
              in, one out; rotary (q, k) -> (q, k); attention (q, k, v)); 389 calls per step.
- ``sglang``  SGLang's signatures: linear layers return ``(output, bias)``, norms take and return
              ``(x, residual)``, rotary ``(positions, q, k)``, attention ``(q, k, v,
              forward_batch)``, decoder layers ``(positions, hidden_states, forward_batch,
              residual)``, self-attention called with keywords; ``forward_batch`` a dataclass of
              ~40 fields, a dozen of them tensors, like SGLang's ForwardBatch; 388 calls per step.
              Run twice: with ForwardBatch registered as a batch context (what the SGLang
              integration does) and without (every module that receives it walks it).

Variants per model: ``plain``, tracer without fingerprints, tracer with fingerprints (CPU tensors:
immediate host values); CPU, float32, ``inference_mode``, lineage off. Prints ms per step and µs
per module call over plain; medians over interleaved rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import random
import statistics
import tempfile
import time

import torch
import torch.nn as nn

from tensor_trace import tracer
from tensor_trace.tracer import native, tensor_slots

H, L, B = 64, 32, 8


def _t(*shape):
    return torch.randn(*shape)


# ---------------------------------------------------------------- llama: nn.Linear-style calls

class _Out(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.out = _t(B, 1, n)

    def forward(self, x):
        return self.out


class _Rot(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = _t(B, 1, H), _t(B, 1, H // 4)

    def forward(self, q, k):
        return self.q, self.k


class _Attn3(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = _t(B, 1, H)

    def forward(self, q, k, v):
        return self.out


class _LlamaAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.rotary_emb, self.attn, self.o_proj = _Out(H + H // 2), _Rot(), _Attn3(), _Out(H)

    def forward(self, x):
        q, k, v = self.qkv_proj(x).split([H, H // 4, H // 4], dim=-1)
        q, k = self.rotary_emb(q, k)
        return self.o_proj(self.attn(q, k, v))


class _LlamaMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.act_fn, self.down_proj = _Out(4 * H), _Out(2 * H), _Out(H)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class _LlamaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = _Out(H), _LlamaAttn()
        self.post_attention_layernorm, self.mlp = _Out(H), _LlamaMLP()
        self.r1, self.r2 = _t(B, 1, H), _t(B, 1, H)

    def forward(self, x):
        self.self_attn(self.input_layernorm(x))
        self.mlp(self.post_attention_layernorm(self.r1))
        return self.r2


class LlamaCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = _Out(H), _Out(H), _Out(1000)
        self.layers = nn.ModuleList(_LlamaLayer() for _ in range(L))

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


# ---------------------------------------------------------------- sglang: SGLang's signatures

class _Mode(enum.IntEnum):
    DECODE = 2


@dataclasses.dataclass
class SamplingInfo:
    temperatures: torch.Tensor = None
    top_ps: torch.Tensor = None
    top_ks: torch.Tensor = None
    min_ps: torch.Tensor = None
    is_all_greedy: bool = True
    vocab_size: int = 1000
    logit_bias: object = None


class _Opaque:
    pass


_FB_NONE = ("top_logprobs_nums extend_num_tokens extend_seq_lens extend_prefix_lens extend_start_loc "
            "extend_prefix_lens_cpu extend_seq_lens_cpu extend_logprob_start_lens_cpu mrope_positions "
            "global_num_tokens_cpu global_num_tokens_gpu dp_local_start_pos spec_info spec_algorithm "
            "capture_hidden_mode lora_ids input_embeds token_ids_logprobs encoder_lens "
            "tbo_split_seq_index").split()
ForwardBatch = dataclasses.make_dataclass(
    "ForwardBatch",
    [("forward_mode", object), ("batch_size", int), ("input_ids", object), ("req_pool_indices", object),
     ("seq_lens", object), ("out_cache_loc", object), ("seq_lens_sum", int), ("orig_seq_lens", object),
     ("return_logprob", bool), ("positions", object), ("sampling_info", object),
     ("req_to_token_pool", object), ("token_to_kv_pool", object), ("attn_backend", object),
     ("num_token_non_padded", object), ("seq_lens_cpu", object), ("padded_static_len", int)]
    + [(name, object, dataclasses.field(default=None)) for name in _FB_NONE])


def forward_batch():
    return ForwardBatch(_Mode.DECODE, B, torch.arange(B), torch.arange(B), torch.full((B,), 64), torch.arange(B),
                        64 * B, torch.full((B,), 64), False, torch.arange(B),
                        SamplingInfo(torch.ones(B), torch.ones(B), torch.ones(B, dtype=torch.int32), torch.zeros(B)),
                        _Opaque(), _Opaque(), _Opaque(), torch.tensor(B), torch.full((B,), 64), -1)


class _PLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.out = _t(B, n)

    def forward(self, x):
        return self.out, None


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.out, self.res = _t(B, H), _t(B, H)

    def forward(self, x, residual=None):
        return self.out if residual is None else (self.out, self.res)


class _SRot(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = _t(B, H), _t(B, H // 4)

    def forward(self, positions, q, k):
        return self.q, self.k


class _SAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = _t(B, H)

    def forward(self, q, k, v, forward_batch):
        return self.out


class _Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = _t(B, 2 * H)

    def forward(self, x):
        return self.out


class _SSelfAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.rotary_emb, self.attn, self.o_proj = _PLinear(H + H // 2), _SRot(), _SAttn(), _PLinear(H)

    def forward(self, positions, hidden_states, forward_batch):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([H, H // 4, H // 4], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        return out


class _SMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.act_fn, self.down_proj = _PLinear(4 * H), _Act(), _PLinear(H)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class _SLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.input_layernorm = _SSelfAttn(), _Norm()
        self.post_attention_layernorm, self.mlp = _Norm(), _SMLP()

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states,
                                       forward_batch=forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class _SModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens, self.norm = _Act(), _Norm()
        self.embed_tokens.out = _t(B, H)
        self.layers = nn.ModuleList(_SLayer() for _ in range(L))

    def forward(self, input_ids, positions, forward_batch):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, forward_batch, residual)
        h, _ = self.norm(h, residual)
        return h


class SGLangCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _SModel()
        self.logits = _t(B, 1000)

    def forward(self, input_ids, positions, forward_batch):
        self.model(input_ids, positions, forward_batch)
        return self.logits


# ---------------------------------------------------------------- measuring

CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def count_calls(step) -> int:
    calls = []
    h = nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        step()
    finally:
        h.remove()
    return len(calls)


def block(step, steps, variant, clock=time.perf_counter_ns) -> float:
    """ms per step of ``steps`` steps (after 3 warm-up steps) under ``variant``."""
    if variant != "plain":
        tracer.start(out_dir=tempfile.mkdtemp(prefix="tt-calls-"), fingerprint=variant == "fp",
                     fingerprint_every=1, lineage=False)  # fp: fingerprints on every step
    try:
        for _ in range(3):
            step()
        t0 = clock()
        for _ in range(steps):
            step()
        return (clock() - t0) / steps / 1e6
    finally:
        if variant != "plain":
            tracer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=CLOCKS, default="wall",
                    help="thread: this thread's CPU time, not wall time (a host shared with other "
                         "work: time spent descheduled is not counted)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    native.ensure(block=True)  # (where enabled) built or loaded now: every block measures it
    llama, sgl = LlamaCalls().eval(), SGLangCalls().eval()
    ids, pos, fb = torch.randint(0, 100, (B,)), torch.arange(B), forward_batch()
    models = {"llama": lambda: llama(ids.view(B, 1)), "sglang": lambda: sgl(ids, pos, fb),
              "sglang-unregistered": lambda: sgl(ids, pos, fb)}
    variants = ("plain", "nofp", "fp")
    res = {(m, v): [] for m in models for v in variants}
    rng = random.Random(0)
    with torch.inference_mode():
        calls = {m: count_calls(step) for m, step in models.items()}
        for _ in range(args.rounds):
            order = list(res)
            rng.shuffle(order)
            for m, v in order:
                if m == "sglang-unregistered":
                    saved = set(tensor_slots.CONTEXT_TYPES)
                    tensor_slots.CONTEXT_TYPES.clear()
                else:
                    tensor_slots.CONTEXT_TYPES.add(ForwardBatch)
                try:
                    res[(m, v)].append(block(models[m], args.steps, v, CLOCKS[args.clock]))
                finally:
                    if m == "sglang-unregistered":
                        tensor_slots.CONTEXT_TYPES.update(saved)
    print(f"# call_patterns {time.strftime('%Y-%m-%d %H:%M')} torch={torch.__version__} rounds={args.rounds} "
          f"steps={args.steps} (CPU, one thread) clock={args.clock} native={native.enabled()} "
          f"load={' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'model':<22}{'calls':>6}  {'plain ms':>9}  {'nofp ms':>8} {'+us/call':>9}  {'fp ms':>8} {'+us/call':>9}")
    out = {}
    for m in models:
        med = {v: statistics.median(res[(m, v)]) for v in variants}
        per = {v: (med[v] - med["plain"]) * 1e3 / calls[m] for v in variants}
        out[m] = dict(calls=calls[m], ms=med, us_per_call_over_plain=per)
        print(f"{m:<22}{calls[m]:>6}  {med['plain']:>9.3f}  {med['nofp']:>8.3f} {per['nofp']:>+9.2f}  "
              f"{med['fp']:>8.3f} {per['fp']:>+9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__,
                           rounds=args.rounds, steps=args.steps, results=out), f, indent=1)


if __name__ == "__main__":
    main()
