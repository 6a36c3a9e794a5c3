"""`train.compile` (toolkit/model/compile.py) on the tiny Qwen3 with LoRA, on CPU.

* Padding the varlen boundaries (empty spans) and fixing `max_length` at the row length changes nothing: the loss
  and gradients of a packed batch are the same to the bit.
* A stage's worth of packed micro-batches of varied packing (different token counts and sample counts) compiles
  once for all layers, not once per batch, nor once per layer (every layer's input needs a gradient, as under
  gradient checkpointing; without it the first layer is a second variant, once); and the compiled run's losses and
  gradients equal the uncompiled ones (fp32). The compiler is Dynamo with a backend that counts the graphs it is
  handed and runs them eagerly: what is counted is what inductor would be asked to compile.
* `train.compile` reaches build_model: the layers compiled in place, the boundaries fixed at the longest stage's row.
* With the CUDA varlen branch (an exact CPU stand-in for the kernel, left out of the graph as the real custom op is
  not), the kernel receives the fixed boundaries: 32 offsets and the row length, every step.

The adapters sit on q_proj and down_proj only (the recipe default is all-linear): each adapted layer is more Python
for Dynamo to trace, and the test must stay fast; the layer's attention and MLP halves both carry one.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from toolkit.builtin.models import materialize_builtin
from toolkit.builtin.text_model import write_tiny_qwen3
from toolkit.config.load import load_recipe
from toolkit.config.stages import resolve_stages
from toolkit.data.encoding import IGNORE_INDEX
from toolkit.data.packing import PackedCollator
from toolkit.model import attention
from toolkit.model.attention import EAGER_PACKED, SDPA_PACKED
from toolkit.model.compile import SLOTS, FixedBoundaries, compile_layers, decoder_layers, pad_boundaries
from toolkit.model.load import apply_lora
from toolkit.train.setup import build_model

ROW = 64  # the stage's row length (data.max_seq_len)
PACKINGS = ((20, 9, 30), (5, 60), (12, 12, 12, 12, 7), (33, 2, 17, 4))  # one micro-batch each: T and spans vary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_compile"))


def lora_model(model_dir: Path, attn: str = SDPA_PACKED) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    torch.manual_seed(0)
    model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "down_proj"], modules_to_save=[])
    for name, p in model.named_parameters():  # PEFT zeroes lora_B: give the adapters a gradient path of their own
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def batch(lengths: tuple[int, ...], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    samples = [{"input_ids": [rng.randrange(3, 900) for _ in range(n)],
                "labels": [IGNORE_INDEX] + [rng.randrange(3, 900) for _ in range(n - 1)]} for n in lengths]
    return PackedCollator()(samples)


def step(model: PreTrainedModel, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class CountingBackend:
    """A Dynamo backend that counts the graphs it is handed and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("attn", [SDPA_PACKED, EAGER_PACKED])
def test_padded_boundaries_attend_exactly_as_the_collators(model_dir: Path, attn: str) -> None:
    model = lora_model(model_dir, attn)
    inputs = batch(PACKINGS[0], seed=0)
    padded = FixedBoundaries(ROW)(model, (), dict(inputs))[1]
    assert padded["cu_seq_lens_q"].tolist() == [0, 20, 29, 59] + [59] * (SLOTS - 4)
    assert padded["max_length_q"] == padded["max_length_k"] == ROW
    assert padded["cu_seq_lens_k"] is padded["cu_seq_lens_q"]
    loss, grads = step(model, inputs)
    padded_loss, padded_grads = step(model, padded)
    assert torch.equal(padded_loss, loss) and grads.keys() == padded_grads.keys()
    assert all(torch.equal(padded_grads[n], g) for n, g in grads.items())
    assert pad_boundaries(torch.arange(SLOTS, dtype=torch.int32)).numel() == SLOTS  # already a multiple: as is
    assert pad_boundaries(torch.arange(SLOTS + 1, dtype=torch.int32)).numel() == 2 * SLOTS


def test_a_stage_compiles_once_per_layer_variant_and_trains_the_same(model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    eager = lora_model(model_dir)
    eager.enable_input_require_grads()  # as gradient checkpointing does: every layer's input needs a gradient
    compiled = copy.deepcopy(eager)
    backend = CountingBackend()
    assert compile_layers(compiled, row_length=ROW, packing=True, backend=backend) == eager.config.num_hidden_layers
    graphs = []
    for i, lengths in enumerate(PACKINGS):
        inputs = batch(lengths, seed=i)
        loss, grads = step(eager, inputs)
        compiled_loss, compiled_grads = step(compiled, inputs)
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=1e-6)
        assert compiled_grads.keys() == grads.keys() and len(grads) > 0
        for name, grad in grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        graphs.append(backend.graphs)
    # All compiled on the first batch, once for both layers: the layer's frames around the span loop of the CPU
    # attention and the packed-or-stock dispatch before it (graph breaks), 7 graphs with torch 2.13. Without the
    # dynamic token count the second batch would compile them all again (Dynamo retraces with the token count
    # dynamic); without the layers sharing one compilation there would be twice as many.
    assert graphs == [graphs[0]] * len(PACKINGS) and graphs[0] <= 7, graphs

    # The CUDA varlen branch, with an exact CPU stand-in for the kernel (left out of the graph: it loops on host
    # values; torch's varlen_attn is a traceable custom op): it receives the fixed boundaries, 32 offsets and the
    # row length, in every layer and step, and the loss is unchanged.
    calls: list[tuple[int, int, int]] = []

    @torch.compiler.disable
    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, *, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
               enable_gqa: bool = False) -> torch.Tensor:
        calls.append((cu_q.numel(), max_q, max_k))
        spans = [(a, b) for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True) if b > a]
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=scale, is_causal=True,
            enable_gqa=enable_gqa).transpose(0, 1) for a, b in spans])

    inputs = [batch(lengths, seed=i) for i, lengths in enumerate(PACKINGS[:2])]
    expected = [step(eager, b)[0] for b in inputs]
    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    monkeypatch.setattr(attention, "varlen_runs", lambda query, dropout: True)
    for b, loss in zip(inputs, expected, strict=True):
        torch.testing.assert_close(step(compiled, b)[0], loss, rtol=1e-6, atol=1e-6)
    assert calls == [(SLOTS, ROW, ROW)] * (2 * compiled.config.num_hidden_layers)


@pytest.mark.parametrize("compile_on", [False, True])
def test_the_recipe_key_compiles_the_built_models_layers(tmp_path: Path, compile_on: bool) -> None:
    """`train.compile` reaches build_model: every decoder layer of the LoRA model compiled in place (parameter names
    unchanged), the boundaries fixed at the longest stage's row; nothing compiled without it."""
    recipe = load_recipe(None, [f"output_dir={tmp_path / 'run'}", "data.packing=true", "data.max_seq_len=96",
                                "stages.0.max_seq_len=128", f"train.compile={str(compile_on).lower()}"])
    resolved = resolve_stages(recipe)
    model, _ = build_model(recipe, resolved, materialize_builtin(recipe.model.name_or_path, tmp_path / "cache"),
                           vision=False)
    decoder, layers = decoder_layers(model)
    assert all((layer._compiled_call_impl is not None) == compile_on for layer in layers)
    hooks = [h for h, _ in decoder._forward_pre_hooks_with_kwargs.items()]
    fixed = [decoder._forward_pre_hooks[h] for h in hooks]
    assert [f.row_length for f in fixed] == ([max(s.max_seq_len for s in resolved)] if compile_on else [])
    assert max(s.max_seq_len for s in resolved) == 128
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())
