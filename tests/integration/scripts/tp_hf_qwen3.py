"""A HuggingFace transformers Qwen3 loaded with its own tensor-parallel plan (``tp_plan="auto"``):
its q_proj and k_proj are column-parallel (not gathered), and the per-head norms q_norm and
k_norm (``replicated_with_grad_allreduce``: replicated weights, nothing done to activations in a
forward) norm each rank's own heads, a 4-D view ``[batch, seq, local heads, head_dim]`` of the
projection's shard. Same command line as tp_hf_llama.py, whose main it runs:

    torchrun --nproc-per-node 2 tp_hf_qwen3.py --ckpt DIR --steps 2 [--dump DIR] [--plan-out FILE]
"""

import tp_hf_llama

# tp_hf_llama's sizes with Qwen3's explicit head_dim (hidden 48 over 6 heads)
SIZES = dict(tp_hf_llama.SIZES, head_dim=8)
BATCH, SEQ = tp_hf_llama.BATCH, tp_hf_llama.SEQ


def write_checkpoint(path):
    """A seeded random Qwen3 in ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tp_hf_llama.save_seeded(path, Qwen3Config, Qwen3ForCausalLM, SIZES)


if __name__ == "__main__":
    tp_hf_llama.main(write_checkpoint)
