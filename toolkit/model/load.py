"""Model building: tokenizer or processor, base model (dtype, attention kernel), gradient checkpointing, LoRA."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from toolkit.checkpoint.final import FINAL_CHECKSUMS, verify_final
from toolkit.errors import ToolkitError
from toolkit.model.trainable import modules_to_train
from toolkit.templates import resolve_chat_template

log = logging.getLogger(__name__)


def check_model_source(name_or_path: str) -> None:
    """Fail early on a model that cannot be loaded: a path-like one that does not exist, or a hub id that is
    neither in the local cache nor reachable (from_pretrained would retry for half a minute, then raise)."""
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
    if looks_local:
        if not (Path(name_or_path).expanduser() / "config.json").is_file():
            raise ToolkitError(f"model.name_or_path '{name_or_path}' is not a model directory (no config.json). "
                               "Give a local directory saved with save_pretrained, or a hub id.")
        if (Path(name_or_path).expanduser() / FINAL_CHECKSUMS).is_file():  # a run's final/ (full fine-tuning)
            verify_final(Path(name_or_path).expanduser())
        return
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            return
    except HFValidationError:
        raise ToolkitError(f"model.name_or_path '{name_or_path}' is neither a local model directory nor a valid "
                           "hub id (owner/name).") from None
    how = (f"Download it where there is network (hf download {name_or_path}) and point HF_HOME at that cache, or "
           "set model.name_or_path to a local directory saved with save_pretrained.")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ToolkitError(f"model.name_or_path '{name_or_path}' is not in the local Hugging Face cache and "
                           f"HF_HUB_OFFLINE is set. {how}")
    try:
        HfApi().model_info(name_or_path, timeout=10)
    except Exception as e:  # network errors come from several libraries; the message is what matters
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ToolkitError(f"model.name_or_path '{name_or_path}' is not in the local Hugging Face cache and the "
                           f"hub cannot provide it ({reason}). {how} For a gated or private model, log in first "
                           "(hf auth login).") from None


def check_remote_code(name_or_path: str, *, trust_remote_code: bool) -> None:
    """Say when model code from the checkpoint will run, and turn transformers' refusal into a recipe hint."""
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ToolkitError(f"model.name_or_path '{name_or_path}' needs its own Python code (auto_map in its "
                           "config.json). Read that code, then set model.trust_remote_code: true in the "
                           "recipe.") from None
    if trust_remote_code and getattr(config, "auto_map", None):
        log.warning("model.trust_remote_code is on: Python code from %s runs in this process (%s).",
                    name_or_path, ", ".join(sorted(config.auto_map)))


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool, chat_template: str | None,
                   local_files_only: bool = False) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with an optional `data.chat_template` override (a name, a path or Jinja text, resolved
    to its text: what the tokenizer saves is the template that trained)."""
    template = resolve_chat_template(chat_template, vision=False) if chat_template is not None else None
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                              local_files_only=local_files_only)
    if template is not None:
        tokenizer.chat_template = template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pad positions carry no loss and no attention
    return tokenizer


def is_vision_language(name_or_path: str, *, trust_remote_code: bool) -> bool:
    """Whether the model is a vision-language model (its config has a `vision_config`, as Qwen2/2.5/3-VL do)."""
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    return getattr(config, "vision_config", None) is not None


def load_processor(name_or_path: str, *, trust_remote_code: bool, chat_template: str | None,
                   local_files_only: bool = False) -> ProcessorMixin:
    """A vision-language model's processor, with an optional `data.chat_template` override resolved to its text
    (`chatml`: the VL ChatML template, with {% generation %} markers). `local_files_only`: a hub id is read from
    the local cache only (OSError when it is not there: preflight never downloads)."""
    template = resolve_chat_template(chat_template, vision=True) if chat_template is not None else None
    if _saved_processor_class(name_or_path) in ("Qwen2_5_VLImageOnlyProcessor", "Qwen3VLImageOnlyProcessor"):
        # The tiny VL models' processor class: AutoProcessor finds it only registered (else it silently returns the
        # tokenizer). Imported here, for such a model only, so loading other models never imports the test models.
        from toolkit.builtin.vl_model import register_image_only_processor

        register_image_only_processor()
    processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                              local_files_only=local_files_only)
    if not isinstance(processor, ProcessorMixin):
        raise ToolkitError(f"model.name_or_path '{name_or_path}' is a vision-language model but AutoProcessor found "
                           f"no processor for it (got a {type(processor).__name__}); its processor_config.json must "
                           "name a processor class that transformers knows.")
    if template is not None:
        processor.chat_template = template
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def load_processing(name_or_path: str, *, vision: bool, trust_remote_code: bool, chat_template: str | None
                    ) -> tuple[PreTrainedTokenizerBase | ProcessorMixin, PreTrainedTokenizerBase]:
    """(processor, tokenizer): a vision-language model's processor (it formats image rows and is saved with the
    model) and its tokenizer; for a text model, its tokenizer twice."""
    if vision:
        processor = load_processor(name_or_path, trust_remote_code=trust_remote_code, chat_template=chat_template)
        return processor, processor.tokenizer
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, chat_template=chat_template)
    return tokenizer, tokenizer


def _saved_processor_class(name_or_path: str) -> str | None:
    """The processor_class a local model directory's processor_config.json names (None for a hub id or none)."""
    try:
        return json.loads((Path(name_or_path) / "processor_config.json").read_text()).get("processor_class")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_dtype(name: str, *, lora: bool) -> torch.dtype:
    """`auto`: bf16 base weights for LoRA on a bf16-capable GPU (frozen, so precision is not lost to updates);
    fp32 otherwise (full fine-tuning keeps fp32 master weights; mixed precision comes from accelerate)."""
    if name != "auto":
        return getattr(torch, name)
    if lora and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_model(name_or_path: str, *, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool,
               vision: bool = False) -> PreTrainedModel:
    """The base causal LM (or image-text-to-text model), loaded with from_pretrained (under ZeRO-3 init when
    accelerate enabled it)."""
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(
        name_or_path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    model.config.get_text_config().use_cache = False  # what a vision-language model's language model reads
    return model


def enable_gradient_checkpointing(model: PreTrainedModel, layers: bool | int = True) -> int:
    """Non-reentrant checkpointing (works with LoRA, ZeRO-3 and FSDP); inputs require grad so frozen
    embeddings still let gradients flow into the checkpointed blocks. `layers`: True for every decoder layer, N for
    the first N of the text decoder (the others keep their activations: faster, more memory). Returns how many
    decoder layers recompute."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    decoder = decoder_layers(model)
    if layers is True:
        return len(decoder)
    if layers > len(decoder):
        raise ToolkitError(f"model.gradient_checkpointing is {layers} but the model has {len(decoder)} decoder layers: "
                           "use true for all of them, or a number up to "
                           f"{len(decoder)}.")
    for layer in decoder[layers:]:  # transformers checks each layer's own flag at every call
        layer.gradient_checkpointing = False
    return layers


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The text decoder's layers, in order (a vision tower's blocks are not among them)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and type(m).__name__.endswith("DecoderLayer")]


def apply_lora(model: PreTrainedModel, *, r: int, alpha: float, dropout: float,
               target_modules: list[str] | str, modules_to_save: list[str],
               exclude_modules: list[str] | str | None = None) -> PeftModel:
    """Wrap the model with PEFT LoRA adapters; only adapters (and modules_to_save) stay trainable."""
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        modules_to_save=modules_to_save or None, exclude_modules=exclude_modules,
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise ToolkitError(f"LoRA could not be applied: {e} Check lora.target_modules / lora.modules_to_save "
                           "against the model's module names.") from None


def setup_lora(model: PreTrainedModel, *, r: int, alpha: float, dropout: float, target_modules: list[str] | str,
               modules_to_save: list[str], exclude_modules: list[str] | str | None,
               stage_trainable: Sequence[Sequence[str] | None], trainable_keys: list[str]) -> PeftModel:
    """A run's LoRA model, as training builds it and export rebuilds it: adapters on `target_modules`, and the
    modules that the stages' `trainable` patterns name (`stage_trainable`, with the recipe keys they come from
    for error messages) trained in full as PEFT modules_to_save, after lora.modules_to_save."""
    extra = modules_to_train(model, stage_trainable, trainable_keys)
    return apply_lora(model, r=r, alpha=alpha, dropout=dropout, target_modules=target_modules,
                      modules_to_save=[*modules_to_save, *extra], exclude_modules=exclude_modules)


def skip_adapter_input_casts(model: torch.nn.Module) -> int:
    """Stop PEFT from casting each adapted layer's input to the adapter's dtype; returns the number of layers.

    Why: LoRA adapters stay fp32 over a 16-bit base (PEFT's autocast_adapter_dtype), and every adapted Linear casts
    its input to fp32 before the adapter, so each one keeps its own fp32 copy of its input for backward (q, k and v
    each copy the same normed hidden states). Under autocast (accelerate's bf16/fp16 mixed precision) the adapter
    matmul runs in 16-bit anyway: the cast buys nothing and costs activation memory, so it is turned off for the
    run, the switch `peft.helpers.disable_input_dtype_casting` flips for a block. Without autocast an fp32 adapter
    cannot take a 16-bit input, so the cast must stay.
    """
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def upcast_trainable(model: torch.nn.Module) -> int:
    """Keep every trainable parameter in fp32 (modules a stage trains in full over a 16-bit base: PEFT's
    modules_to_save copies take the base's dtype); returns how many were cast.

    Why: an optimizer without master weights (single, DDP, FSDP2) steps a bf16 weight in bf16, where an update
    smaller than half a unit in the last place (2**-9 relative) is lost: a norm weight near 1.0 never moves at a
    learning rate of 1e-3. PEFT keeps LoRA adapters in fp32 for the same reason; under autocast they compute in
    16-bit all the same. DeepSpeed keeps fp32 masters of whatever it is given.
    """
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
            cast += 1
    return cast


