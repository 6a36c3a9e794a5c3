"""Parameter counts, one owner: of a decoder config by formula (`count_params`), of the real model built on the meta
device (`meta_parameter_counts`), and of a loaded model, ZeRO-3 shards included (`count_parameters`). Counts of
both kinds are (total, trainable)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
)

from toolkit.strategies.deepspeed import full_numel


def decoder_config(config: Any) -> Any:
    """The decoder part of a config (the text model of a vision-language config)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def count_params(config: Any) -> dict[str, int]:
    """Weight counts of a decoder config, split the way FLOPs and memory need them.

    Keys: ``attention_per_layer``, ``mlp_per_layer``, ``per_layer`` (matmul weights of one layer),
    ``layers`` (all layers), ``lm_head``, ``embeddings``, ``matmul`` (N above: layers + LM head) and
    ``total`` (unique weights: layers + embeddings, + LM head unless tied). Norm weights and biases are
    tiny and not counted.
    """
    c = decoder_config(config)
    h, inter, layers = int(c.hidden_size), int(c.intermediate_size), int(c.num_hidden_layers)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or h // heads)
    vocab = int(c.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False)))
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter
    lm_head = h * vocab
    return {
        "attention_per_layer": attention,
        "mlp_per_layer": mlp,
        "per_layer": attention + mlp,
        "layers": layers * (attention + mlp),
        "lm_head": lm_head,
        "embeddings": vocab * h,
        "matmul": layers * (attention + mlp) + lm_head,
        "total": layers * (attention + mlp) + vocab * h + (0 if tied else lm_head),
    }


def _build_meta_model(config: Any, lora_r: int | None, lora_targets: str | list[str]) -> torch.nn.Module:
    """The real model class for ``config`` on the meta device (no memory), LoRA-wrapped when ``lora_r``."""

    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT probes a deprecated transformers property
        model = auto.from_config(config)
        if lora_r:
            from peft import LoraConfig, get_peft_model

            targets = lora_targets if isinstance(lora_targets, str) else list(lora_targets)
            model = get_peft_model(model, LoraConfig(r=lora_r, target_modules=targets, task_type="CAUSAL_LM"))
    return model


def param_table(config: Any, lora_r: int | None, lora_targets: str | Iterable[str]
                 ) -> tuple[tuple[str, int, bool], ...]:
    """(name, numel, trainable) of every parameter of the meta skeleton, cached per config and LoRA setup
    (building an 8B skeleton takes a second or two; a table of strategies asks for it several times)."""
    targets = lora_targets if isinstance(lora_targets, str) else tuple(lora_targets)
    key = (config.to_json_string(use_diff=False), lora_r or None, targets)
    if key not in _TABLES:
        model = _build_meta_model(config, lora_r or None, targets if isinstance(targets, str) else list(targets))
        _TABLES[key] = tuple((name, p.numel(), p.requires_grad) for name, p in model.named_parameters())
    return _TABLES[key]


def meta_parameter_counts(config: Any, *, lora_r: int | None, lora_targets: str | Iterable[str] = "all-linear"
                          ) -> tuple[int, int]:
    """(total, trainable) parameters, counted exactly on the real model built on the meta device."""
    table = param_table(config, lora_r, lora_targets)
    return sum(n for _, n, _ in table), sum(n for _, n, t in table if t)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; correct under ZeRO-3, where local tensors are empty shards."""
    trainable = total = 0
    for p in model.parameters():
        n = full_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


_TABLES: dict[tuple[str, int | None, str | tuple[str, ...]], tuple[tuple[str, int, bool], ...]] = {}
