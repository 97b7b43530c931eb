"""A HuggingFace transformers OLMo 2 loaded with its own tensor-parallel plan (``tp_plan="auto"``):
its attention projections are column-parallel with the output gathered (``colwise_gather_output``:
q_norm and k_norm then norm whole rows), its ``o_proj`` slices a replicated input inside the call
(``rowwise_split_input``), and its norms come after the attention and the MLP. Same command line
as tp_hf_llama.py, whose main it runs:

    torchrun --nproc-per-node 2 tp_hf_olmo2.py --ckpt DIR --steps 2 [--dump DIR] [--plan-out FILE]
"""

import tp_hf_llama

SIZES, BATCH, SEQ = tp_hf_llama.SIZES, tp_hf_llama.BATCH, tp_hf_llama.SEQ


def write_checkpoint(path):
    """A seeded random OLMo 2 in ``path``."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    tp_hf_llama.save_seeded(path, Olmo2Config, Olmo2ForCausalLM, SIZES)


if __name__ == "__main__":
    tp_hf_llama.main(write_checkpoint)
