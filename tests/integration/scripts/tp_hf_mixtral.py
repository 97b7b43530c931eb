"""A HuggingFace transformers Mixtral (a mixture of experts) loaded with its own tensor-parallel
plan (``tp_plan="auto"``): transformers shards each expert's stacked weights (``packed_colwise``
on ``mlp.experts.gate_up_proj``, ``rowwise`` on ``mlp.experts.down_proj``) and all-reduces the
experts' output (``moe_tp_experts``); the experts run on local tensors inside one call
(transformers.integrations.moe). Same command line as tp_hf_llama.py, whose main it runs:

    torchrun --nproc-per-node 2 tp_hf_mixtral.py --ckpt DIR --steps 2 [--dump DIR] [--plan-out FILE]
"""

import tp_hf_llama

# tp_hf_llama's sizes (its token ids are drawn from the same vocabulary), with 4 experts, 2 per token
SIZES = dict(tp_hf_llama.SIZES, num_local_experts=4, num_experts_per_tok=2)
BATCH, SEQ = tp_hf_llama.BATCH, tp_hf_llama.SEQ


def write_checkpoint(path):
    """A seeded random Mixtral in ``path``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tp_hf_llama.save_seeded(path, MixtralConfig, MixtralForCausalLM, SIZES)


if __name__ == "__main__":
    tp_hf_llama.main(write_checkpoint)
