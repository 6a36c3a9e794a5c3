"""The tiny Qwen3 with a seeded LoRA adapter whose B matrices are not zero: the same model on every call and in
every process, so that our losses and TRL's (tests/train/test_preference.py, test_grpo.py, test_kto.py) and a
launched helper's (tests/helpers/rl_step.py) start from one policy."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel


def seeded_lora(path: str, attn: str = "sdpa", *, use_cache: bool = False) -> PreTrainedModel:
    """The model at `path` in fp32 with LoRA r4 on q_proj / v_proj: A as PEFT initialises it under seed 0, B drawn
    from seed 0 at scale 0.05 (not zero, so the adapter changes the outputs from the first step). `use_cache` as
    given: the scoring tests run without a KV cache, the rollouts with one."""
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    base.config.use_cache = use_cache
    torch.manual_seed(0)  # lora_A's initialisation
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model
