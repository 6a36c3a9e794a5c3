"""StageFreezer: a stage's frozen groups get no update, also after the optimizer's state was loaded (a resume)."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from toolkit.train.optimizer import StageFreezer, create_optimizer_state


def two_group_run() -> tuple[torch.nn.Module, torch.optim.Optimizer, StageFreezer]:
    """A two-layer model whose layers train in different stages: 'a' in stage 0, 'b' in stage 1."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    groups = [((True, False), ["0.weight", "0.bias"]), ((False, True), ["1.weight", "1.bias"])]
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [params[n] for n in names]} for _, names in groups], lr=0.1)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, StageFreezer(accelerator, model, optimizer, groups)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, freezer: StageFreezer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    freezer.drop_frozen_grads()
    optimizer.step()
    optimizer.zero_grad()


def test_stage_change_after_a_loaded_optimizer_state_freezes_the_right_groups() -> None:
    """`load_state_dict` (what a resume does) replaces the optimizer's param-group dicts: the freezer must mark the
    live ones. It used to mark the replaced dicts, so after a resume the next stage trained the previous stage's
    parameters and froze its own (exact resume broke at the first stage change)."""
    model, optimizer, freezer = two_group_run()
    freezer.set_stage(0)
    train_step(model, optimizer, freezer)
    optimizer.load_state_dict(optimizer.state_dict())  # a resume at the end of stage 0
    freezer.set_stage(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, optimizer, freezer)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in ("0.weight", "0.bias")), "stage 0's layer moved in stage 1"
    assert not torch.equal(after["1.weight"], before["1.weight"]), "stage 1's layer did not train"
    inner = optimizer.optimizer
    steps = [int(inner.state[g["params"][0]]["step"]) for g in inner.param_groups]
    assert steps == [1, 1], f"Adam step counts {steps}: each layer updated once, in its own stage"


def test_optimizer_state_exists_from_the_start_and_changes_nothing() -> None:
    """Every parameter has its Adam state (zero moments, step 0) before any update, so a checkpoint taken before a
    group's first update holds it (FSDP2's loader refused such checkpoints: "Missing key in checkpoint
    state_dict"); parameters are untouched, even with weight decay, and training is bit-identical to an optimizer
    that created its state lazily."""
    def trained(precreate: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        if precreate:
            create_optimizer_state(optimizer)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
            for p in model.parameters():
                state = optimizer.state[p]
                assert int(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
                assert p.grad is None
            assert optimizer.param_groups[0]["lr"] == 0.1
        for _ in range(2):
            model(torch.ones(3, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(trained(True), trained(False), strict=True))


def test_optimizer_state_creation_puts_existing_gradients_back() -> None:
    """ZeRO-1/2 with optimizer offload keeps pinned CPU gradient buffers on its fp32 partitions from the start and
    writes into them in backward: creating the state must leave them (it set them to None, and every ZeRO-2 offload
    launch failed in its first backward)."""
    flat = torch.nn.Parameter(torch.ones(6))
    buffer = torch.zeros(6)
    flat.grad = buffer
    optimizer = torch.optim.AdamW([flat], lr=0.1)
    create_optimizer_state(optimizer)
    assert flat.grad is buffer and not buffer.any() and int(optimizer.state[flat]["step"]) == 0
