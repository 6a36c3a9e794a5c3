"""lora.fused (toolkit/model/fused_lora.py): the fused LoRA Linears against PEFT's on the same weights and batch, on
a real tiny Qwen3 on the CPU: one layer at a time, the same logits and loss, every gradient and the saved adapter
bitwise (the fused function runs PEFT's operations in PEFT's order and dtypes); with q/k/v and gate/up grouped, the
same to rounding (their sums run in another order); less kept for backward (x @ A^T is recomputed); and the cases it
cannot reproduce falling back to PEFT (dropout) or refused (`on`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from tests.train.test_loop import _kept, build_run  # noqa: F401  (the fixture keeps signal handlers off the runner)
from toolkit.builtin.models import TINY_MODEL, materialize_builtin
from toolkit.config.identity import recipe_hash, resume_invariants
from toolkit.config.load import load_recipe
from toolkit.errors import ToolkitError
from toolkit.model import fused_lora
from toolkit.model.fused_lora import FusedLoraLinear, LoraAddFunction, check_fused_lora, install_fused_lora
from toolkit.model.load import apply_lora, load_model, skip_adapter_input_casts
from toolkit.train.loop import enter_stage, run_step

R = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return materialize_builtin(TINY_MODEL, tmp_path_factory.mktemp("models"))


def peft_model(path: str, *, dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> torch.nn.Module:
    """The tiny Qwen3 with LoRA on every Linear and the head trained in full (modules_to_save); lora_B drawn
    non-zero so the adapters change the outputs and every gradient."""
    torch.manual_seed(0)
    model = load_model(path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False)
    model = apply_lora(model, r=R, alpha=16, dropout=dropout, target_modules="all-linear",
                       modules_to_save=["lm_head"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


def pair(path: str, *, group: bool = False, **kwargs: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(PEFT's model, the same model with `lora.fused: on`), with the same weights; `group`: q/k/v and gate/up
    grouped (as training runs them), else each layer alone."""
    peft = peft_model(path, **kwargs)  # type: ignore[arg-type]
    fused = peft_model(path, **kwargs)  # type: ignore[arg-type]  # built alike (a deepcopy reorders the config's sets)
    assert all(torch.equal(a, b) for a, b in zip(peft.state_dict().values(), fused.state_dict().values(), strict=True))
    done = install_fused_lora(fused, "on", group=group)
    assert (done.fused, done.groups) == (14, 4 if group else 0)  # 2 layers x (q, k, v, o, gate, up, down)
    return peft, fused


def forward_backward(model: torch.nn.Module, ids: torch.Tensor, *, autocast: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits, out.loss, grads


BATCH = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, True),
                                                 (torch.bfloat16, False)],
                         ids=["fp32", "bf16-autocast", "bf16-base-fp32-adapters"])
def test_each_layer_alone_is_peft_s_bitwise(tiny: str, dtype: torch.dtype, autocast: bool) -> None:
    """fp32; a bf16 base under bf16 autocast with the input casts off (as build_model runs it); a bf16 base
    without autocast, whose fp32 adapters take an fp32 copy of the input (PEFT's cast)."""
    peft, fused = pair(tiny, dtype=dtype)
    if autocast:
        skip_adapter_input_casts(peft), skip_adapter_input_casts(fused)
    assert [n for n, _ in peft.named_parameters()] == [n for n, _ in fused.named_parameters()]
    assert all(type(m) is FusedLoraLinear for m in fused.modules() if isinstance(m, LoraLinear))
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj  # the fused function runs, not PEFT's forward
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(torch.randn(1, 3, layer.in_features, dtype=dtype, requires_grad=True))
    assert type(out.grad_fn).__name__ == f"{LoraAddFunction.__name__}Backward"
    logits, loss, grads = forward_backward(peft, BATCH, autocast=autocast)
    fused_logits, fused_loss, fused_grads = forward_backward(fused, BATCH, autocast=autocast)
    assert torch.equal(fused_logits, logits) and torch.equal(fused_loss, loss)
    assert grads.keys() == fused_grads.keys() and len(grads) == 2 * 14 + 1  # A and B of 14 layers, the head
    assert all(torch.equal(fused_grads[n], g) for n, g in grads.items()), [
        n for n, g in grads.items() if not torch.equal(fused_grads[n], g)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # eval: fused too
        assert torch.equal(fused(input_ids=BATCH).logits, peft(input_ids=BATCH).logits)


def test_grouped_layers_are_peft_s_to_rounding(tiny: str) -> None:
    """q/k/v and gate/up grouped: x @ [A_q; A_k; A_v]^T in one matmul (its fp32 CPU kernel for 24 columns rounds
    otherwise than for 8) and the input's gradient summed over every member's rank at once (PEFT adds three),
    so fp32 agrees to rounding; under bf16 autocast the logits are still bitwise (the bf16 kernels agree) and the
    gradients to bf16 rounding (PEFT rounds each layer's input gradient to bf16 before adding the next)."""
    peft, fused = pair(tiny, group=True)
    logits, loss, grads = forward_backward(peft, BATCH)
    fused_logits, fused_loss, fused_grads = forward_backward(fused, BATCH)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=0, atol=1e-6 * float(g.abs().max()), msg=name)
    groups = {id(m.lora_group): m.lora_group for m in fused.modules() if "lora_group" in m.__dict__}
    assert len(groups) == 4 and all(g.grouping and not g.pending and g.x is None for g in groups.values())
    skip_adapter_input_casts(peft), skip_adapter_input_casts(fused)
    logits, _, grads = forward_backward(peft, BATCH, autocast=True)
    fused_logits, _, fused_grads = forward_backward(fused, BATCH, autocast=True)
    assert torch.equal(fused_logits, logits)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=0, atol=2 ** -5 * float(g.abs().max()), msg=name)


def test_a_group_whose_members_take_other_inputs_runs_them_alone(tiny: str, caplog: pytest.LogCaptureFixture
                                                                  ) -> None:
    """A model that does not call q, k and v on one input (cross-attention, say) gets each layer's own output."""
    peft, fused = pair(tiny, group=True)
    layers = [m.base_model.model.model.layers[0].self_attn for m in (peft, fused)]
    x1, x2 = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="toolkit.model.fused_lora"):
        torch.testing.assert_close(layers[1].q_proj(x1), layers[0].q_proj(x1), rtol=1e-6, atol=1e-6)  # grouped
        assert torch.equal(layers[1].k_proj(x2), layers[0].k_proj(x2))
        assert torch.equal(layers[1].v_proj(x2), layers[0].v_proj(x2))
    assert "model.model.layers.0.self_attn.q_proj/k_proj/v_proj are not called on one input" in caplog.text
    assert not layers[1].q_proj.lora_group.grouping


def test_the_saved_adapter_after_a_step_is_peft_s_byte_for_byte(tiny: str, tmp_path: Path) -> None:
    peft, fused = pair(tiny)
    for model, out in ((peft, tmp_path / "peft"), (fused, tmp_path / "fused")):
        forward_backward(model, BATCH)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
        model.save_pretrained(out)
    files = sorted(p.name for p in (tmp_path / "peft").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "fused").iterdir())
    assert "adapter_model.safetensors" in files
    for name in files:
        assert (tmp_path / "peft" / name).read_bytes() == (tmp_path / "fused" / name).read_bytes(), name


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward (a tensor kept by several
    nodes, as the same x by q, k and v, counted once), the model's weights left out: held anyway, they cost
    nothing to keep (the fused layers keep every adapter weight by reference; PEFT's nodes only those they need)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(storages.values())


def test_fused_layers_keep_less_for_backward(tiny: str) -> None:
    """PEFT keeps x @ A^T of every adapted layer; the fused layers recompute it, alone or grouped: that much less,
    exactly (a group keeps its shared input once, as PEFT's q, k and v share theirs)."""
    peft, alone = pair(tiny)
    grouped = peft_model(tiny)
    assert install_fused_lora(grouped, "on").groups == 4
    kept = saved_bytes(peft, BATCH)
    for fused in (alone, grouped):
        assert kept - saved_bytes(fused, BATCH) == 14 * BATCH.numel() * R * 4  # one fp32 tokens x r tensor a layer


def test_dropout_falls_back_to_peft_with_a_log_line(tiny: str, caplog: pytest.LogCaptureFixture) -> None:
    model = peft_model(tiny, dropout=0.1)
    with caplog.at_level(logging.INFO, logger="toolkit.model.fused_lora"):
        assert install_fused_lora(model, "on").fused == 0
    assert "lora.fused is on but LoRA dropout is on (lora.dropout > 0)" in caplog.text
    assert "set lora.dropout: 0 to fuse them" in caplog.text
    assert all(type(m) is LoraLinear for m in model.modules() if isinstance(m, LoraLinear))


def test_auto_and_off_keep_peft_s_layers(tiny: str, caplog: pytest.LogCaptureFixture) -> None:
    model = peft_model(tiny)
    with caplog.at_level(logging.INFO, logger="toolkit.model.fused_lora"):
        assert install_fused_lora(model, "auto").fused == 0
        assert install_fused_lora(model, "off").fused == 0
    assert "fused LoRA: 0 of 14 LoRA Linear layers (lora.fused: auto runs PEFT's layers until a GPU has measured " \
           "the fused ones; lora.fused: on fuses them)" in caplog.text
    assert all(type(m) is LoraLinear for m in model.modules() if isinstance(m, LoraLinear))


def test_on_is_refused_where_it_cannot_fuse(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_model(tiny, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=False)
    dora = get_peft_model(base, LoraConfig(r=R, target_modules=["q_proj"], use_dora=True, task_type="CAUSAL_LM"))
    with pytest.raises(ToolkitError, match=r"lora\.fused is on but LoRA layer .*q_proj cannot be fused: it is a "
                                           r"DoRA .* Set lora\.fused: off"):
        install_fused_lora(dora, "on")
    with pytest.raises(ToolkitError, match=r"lora\.fused is on but this run uses DeepSpeed ZeRO-3"):
        check_fused_lora("on", "zero3_offload")  # at the launch, before the data work
    for mode, strategy in (("on", "zero2"), ("on", "fsdp"), ("auto", "zero3"), ("off", "zero3")):
        check_fused_lora(mode, strategy)
    model = peft_model(tiny)
    monkeypatch.setattr("transformers.integrations.is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ToolkitError, match=r"lora\.fused is on but this run uses DeepSpeed ZeRO-3"):
        install_fused_lora(model, "on")
    assert install_fused_lora(model, "auto").fused == 0  # auto never fuses under ZeRO-3 either
    with pytest.raises(ToolkitError, match=r"lora\.fused is 'yes'; choose one of auto, on, off"):
        install_fused_lora(model, "yes")
    assert fused_lora.FUSED_LORA == ("auto", "on", "off")


def test_only_lora_fused_on_binds_a_checkpoint() -> None:
    """auto and off run PEFT's layers: earlier checkpoints' hashes (written before the key existed) still match;
    on's grouped layers round otherwise, so a resume may not switch to or from it unforced."""
    recipes = [load_recipe(None, [f"lora.fused={v}"]) for v in ("auto", "off", "on")]
    assert [r.lora.fused for r in recipes] == ["auto", "off", "on"]  # YAML's on / off (true / false) as written
    hashes = [recipe_hash(resume_invariants(r)) for r in recipes]
    assert hashes[0] == hashes[1] != hashes[2]
    assert "fused" not in resume_invariants(recipes[0])["lora"]
    assert resume_invariants(recipes[2])["lora"]["fused"] == "on"


def test_a_short_run_has_the_same_losses_fused_and_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two steps of the loop in this process (build_model wires the key), with lora.fused on and off."""
    losses, weights = {}, {}
    for mode in ("off", "on"):
        with caplog.at_level(logging.INFO, logger="toolkit.model.fused_lora"):
            run = build_run(tmp_path / mode, f"lora.fused={mode}", "stages.0.max_steps=2")
        model = run.accelerator.unwrap_model(run.model)
        assert any(type(m) is FusedLoraLinear for m in model.modules()) == (mode == "on")
        stage = run.curriculum.stages[0]
        enter_stage(run, stage, 0)
        losses[mode] = [run_step(run, stage, step, step).loss for step in range(2)]
        weights[mode] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert ("fused LoRA: 14 of 14 LoRA Linear layers, 4 groups sharing an input (q/k/v, gate/up) (lora.fused: on; "
            "lora.fused: off runs PEFT's)") in caplog.text
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-6)  # grouped q/k/v and gate/up: to rounding
    assert weights["on"].keys() == weights["off"].keys()
    for name, w in weights["off"].items():
        torch.testing.assert_close(weights["on"][name], w, rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.equal(w, 0 * w) for n, w in weights["off"].items() if "lora_B" in n)  # steps moved B
