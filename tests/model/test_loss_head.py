"""The chunked loss head (toolkit/model/loss_head.py) equals transformers' standard head exactly, in fp32.

Each case runs the same model on the same batch twice, standard head then chunked head (several chunks), and
compares the loss and every trainable gradient within 1e-5: LoRA on the decoder, LoRA on lm_head itself with tied
embeddings, full fine-tuning, packed rows with position_ids and gradient checkpointing, and a micro-batch without
any label token. Evaluation (no grad) and calls without labels are covered too, and a head whose weight exists only
while the head module runs (ZeRO-3's contract, simulated with the same module hooks): the loss must be computed
there. (Real ZeRO-3 / FSDP2 runs of the head are in tests/e2e/test_strategies.py.)
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from toolkit.config.load import load_recipe
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.errors import ToolkitError
from toolkit.model.loss_head import (
    LossHead,
    default_chunk_tokens,
    install_loss_head,
    liger_available,
    shifted_labels,
    triton_interpreted,
)

VOCAB = 301


def tiny_model(*, tied: bool = False) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
                         use_cache=False, dtype="float32")
    return Qwen3ForCausalLM(config).float()


def lora(model: torch.nn.Module, targets: list[str] | str = "all-linear") -> torch.nn.Module:
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    with torch.no_grad():  # B starts at zero: give it values so the adapters' gradients are all nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def padded_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 17), generator=g)
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt
    labels[1, 11:] = IGNORE_INDEX  # padding
    labels[2, 7:9] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed_batch() -> dict[str, torch.Tensor]:
    """Three samples in one row: position_ids restart, every sample's first label is ignored."""
    g = torch.Generator().manual_seed(2)
    lengths = [9, 14, 6]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels[pos == 0] = IGNORE_INDEX
    labels[0, 10:13] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs: object
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


def assert_same_as_standard(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = 5,
                            **kwargs: object) -> LossHead:
    ref_loss, ref_grads = loss_and_grads(model, batch, **kwargs)
    head = install_loss_head(model, "chunked", chunk)
    assert head is not None
    loss, grads = loss_and_grads(model, batch, **kwargs)
    assert head.calls == 1, "the chunked head did not compute this loss"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() == trainable
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().max() > 0 for g in grads.values())
    return head


def items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum().float() * 1.5  # as if other ranks had more


def test_lora_padded_batch_with_num_items_in_batch() -> None:
    batch = padded_batch()
    assert_same_as_standard(lora(tiny_model()), batch, num_items_in_batch=items(batch))


def test_lora_on_lm_head_with_tied_embeddings_mean_loss() -> None:
    model = lora(tiny_model(tied=True), ["q_proj", "v_proj", "lm_head"])
    assert type(model.get_base_model().lm_head).__name__ == "Linear" and hasattr(
        model.get_base_model().lm_head, "lora_A")  # PEFT's lora.Linear around the head
    head = assert_same_as_standard(model, padded_batch(), chunk=7)
    assert any("lm_head.lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert head.kind == "chunked"


def test_full_finetuning_packed_rows_with_gradient_checkpointing() -> None:
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = packed_batch()
    assert_same_as_standard(model, batch, chunk=4, num_items_in_batch=items(batch))


def test_micro_batch_without_label_tokens_keeps_the_head_in_the_graph() -> None:
    model = lora(tiny_model(), ["q_proj", "lm_head"])
    batch = padded_batch()
    batch["labels"][:] = IGNORE_INDEX
    install_loss_head(model, "chunked", 4)
    loss, grads = loss_and_grads(model, batch, num_items_in_batch=torch.tensor(8.0))
    assert loss.item() == 0.0
    assert any("lm_head" in n for n in grads), "lm_head's adapters left the graph (DDP would wait for them)"


def test_evaluation_and_calls_without_labels() -> None:
    model = lora(tiny_model())
    batch = padded_batch()
    model.eval()
    with torch.no_grad():
        ref = model(**batch, num_items_in_batch=torch.ones(())).loss
        unlabelled = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**unlabelled).logits
        head = install_loss_head(model, "chunked", 3)
        got = model(**batch, num_items_in_batch=torch.ones(())).loss  # evaluate()'s call: the summed loss
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert head is not None and head.calls == 1
        torch.testing.assert_close(model(**unlabelled).logits, logits)  # generation: real logits
        assert head.calls == 1
        head.remove()
        torch.testing.assert_close(model(**batch).logits, logits)


def test_recipe_keys_and_the_default_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe(None, [])
    assert recipe.model.loss_head == "auto" and recipe.model.loss_chunk_size is None
    assert default_chunk_tokens(151_936) == 220 and default_chunk_tokens(1024) == 32768
    for bad in ("model.loss_head=fused", "model.loss_chunk_size=0"):
        with pytest.raises(ToolkitError, match=bad.split("=")[0].split(".")[1]):
            load_recipe(None, [bad])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not (torch.cuda.is_available() and liger_available()):  # CPU CI: an explicit liger fails with the fix
        with pytest.raises(ToolkitError, match=r"model\.loss_head is liger"):
            install_loss_head(tiny_model(), "liger")


def test_standard_leaves_the_model_alone_and_auto_is_chunked_on_cpu() -> None:
    model = tiny_model()
    assert install_loss_head(model, "standard") is None
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    head = install_loss_head(tiny_model(), "auto")
    assert head is not None
    if not torch.cuda.is_available():
        assert head.kind == "chunked"


class GatheredOnlyInForward:
    """ZeRO-3's contract for the head's weight, on one process: the full weight exists only while the head module
    runs (forward pre-hook gathers, forward hook releases to an empty tensor, as DeepSpeed does with
    `param.data`) and again for its backward (backward pre-hook). DeepSpeed itself left this tiny model's head
    weight gathered after the head's forward (tests/e2e/test_strategies.py), so this is the way to test that the loss
    is computed where the weight exists."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.head, self.full = head, head.weight.data
        head.register_forward_pre_hook(lambda *_: self.gather())
        head.register_forward_hook(lambda *_: self.release())
        head.register_full_backward_pre_hook(lambda *_: self.gather())

    def gather(self) -> None:
        self.head.weight.data = self.full

    def release(self) -> None:
        self.head.weight.data = torch.empty(0)


def test_the_loss_is_computed_where_a_sharded_head_weight_is_gathered() -> None:
    model = tiny_model()  # full fine-tuning: the head's weight itself trains
    batch = padded_batch()
    harness = GatheredOnlyInForward(model.lm_head)
    model(**batch)
    assert model.lm_head.weight.numel() == 0  # released after the head's forward, like a ZeRO-3 partition
    with pytest.raises(RuntimeError):  # what reading the weight outside the head's forward would meet
        torch.nn.functional.linear(torch.randn(2, 32), model.lm_head.weight)
    head = assert_same_as_standard(model, batch, chunk=4, num_items_in_batch=items(batch))
    assert head.calls == 1
    harness.gather()


# ------------------------------------------------------------------- Liger's fused kernel, in Triton's interpreter


def liger_against_chunked(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs: object) -> None:
    """The Liger head gives the chunked head's loss and gradients (fp32, within 1e-5) on the same model and batch."""
    chunked = install_loss_head(model, "chunked", 5)
    assert chunked is not None
    ref_loss, ref_grads = loss_and_grads(model, batch, **kwargs)
    chunked.remove()
    liger = install_loss_head(model, "liger")
    assert liger is not None and liger.kind == "liger"
    loss, grads = loss_and_grads(model, batch, **kwargs)
    assert liger.calls == 1, "the Liger head did not compute this loss"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and any(g.abs().max() > 0 for g in grads.values())
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


needs_liger = pytest.mark.skipif(not (liger_available() and triton_interpreted()),
                                 reason="needs liger-kernel (the dev extra) and TRITON_INTERPRET=1 (tests/conftest.py)")


@needs_liger
def test_liger_equals_chunked_on_tiny_qwen3() -> None:
    batch = packed_batch()
    liger_against_chunked(lora(tiny_model()), batch, num_items_in_batch=items(batch))
    liger_against_chunked(tiny_model(), padded_batch())  # full fine-tuning: the head's weight gradient too


@needs_liger
def test_liger_equals_chunked_on_tiny_qwen2_5_vl(models: dict[str, str]) -> None:
    from transformers import AutoModelForImageTextToText

    from toolkit.data.collate import VLCollator
    from toolkit.model.load import load_processor

    processor = load_processor(models["vl"], trust_remote_code=False, chat_template=None)
    torch.manual_seed(0)
    model = lora(AutoModelForImageTextToText.from_pretrained(models["vl"], dtype=torch.float32),
                 ["q_proj", "v_proj"])  # the language model's attention (the vision blocks name theirs qkv)
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (11, 7):
        ids = torch.randint(10, 200, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 3 + ids[3:]})
    batch = VLCollator(processor)(rows)  # text rows: the masked dummy image runs the vision tower too
    assert "pixel_values" in batch
    liger_against_chunked(model, batch)


def test_the_head_runs_when_the_model_forward_is_called_directly() -> None:
    """PEFT before 0.21 runs the base model as `model.forward(...)`, which skips module hooks: the head must still
    see the labels (it wraps forward), or the full-logits head would run without a word."""
    model = tiny_model()
    batch = padded_batch()
    ref = model(**batch).loss
    head = install_loss_head(model, "chunked", 4)
    assert head is not None
    torch.testing.assert_close(model.forward(**batch).loss, ref, rtol=1e-5, atol=1e-6)
    assert head.calls == 1
    head.remove()
    assert "forward" not in vars(model)


def test_per_token_log_probs_at_a_temperature_equal_full_logits() -> None:
    """`LossHead.per_token`: each label token's log-probability at the temperature (and entropy), in label order,
    with the gradient of full logits' log_softmax (LoRA on lm_head too: the head's own forward runs per chunk)."""
    batch = padded_batch()
    target = shifted_labels(batch["labels"])
    keep = target != IGNORE_INDEX
    weights = torch.linspace(-1.0, 2.0, int(keep.sum()))  # a weighted sum, as an RL loss makes of them

    def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = lora(tiny_model(), ["q_proj", "v_proj", "lm_head"])
    logits = reference(**{k: v for k, v in batch.items() if k != "labels"}).logits.float() / 0.7
    full = torch.log_softmax(logits, -1)
    expected = full[keep].gather(-1, target[keep].unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(full.exp() * full).sum(-1)[keep]
    (expected * weights).sum().backward()

    model = lora(tiny_model(), ["q_proj", "v_proj", "lm_head"])
    head = install_loss_head(model, "chunked", chunk_tokens=5)
    assert head is not None
    with head.per_token(0.7, entropy=True) as kept:
        out = model(**batch, num_items_in_batch=torch.ones(()))
    assert kept.logps is not None and kept.entropies is not None
    torch.testing.assert_close(kept.logps, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(kept.entropies, expected_entropy.detach(), rtol=0, atol=1e-5)
    assert not kept.entropies.requires_grad and len(kept.chunks or []) > 2
    torch.testing.assert_close(out.loss, -kept.logps.sum(), rtol=1e-6, atol=1e-6)  # the call's own loss
    ((kept.logps * weights).sum() + 0.0 * out.loss).backward()
    ours, theirs = grads(model), grads(reference)
    assert ours.keys() == theirs.keys() and any("lm_head.lora" in n for n in ours)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        model(**batch)  # outside the block: nothing kept
    assert head.tokens is None
