"""GPU defaults of toolkit/runtime/process.py, checked on CPU: the allocator config, TF32, fused AdamW on CUDA."""

from __future__ import annotations

import types

import pytest
import torch

from toolkit.runtime import process as distributed
from toolkit.train.optimizer import build_optimizer


def test_expandable_segments_unless_the_user_set_an_allocator_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in distributed.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in distributed.gpu_defaults()
    assert distributed.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for var in distributed.ALLOC_CONF_VARS:  # the user's own setting, under either name, is kept
        for other in distributed.ALLOC_CONF_VARS:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(var, "max_split_size_mb:128")
        assert distributed.gpu_defaults() == []
        assert distributed.os.environ[var] == "max_split_size_mb:128"
        assert all(other not in distributed.os.environ for other in distributed.ALLOC_CONF_VARS if other != var)


def test_tf32_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert distributed.gpu_defaults() == [] and not torch.backends.cuda.matmul.allow_tf32
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert distributed.gpu_defaults() == ["TF32 for fp32 matmuls"]
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize(("device", "fused"), [("cuda", True), ("cpu", None)])
def test_adamw_is_fused_on_cuda(monkeypatch: pytest.MonkeyPatch, device: str, fused: bool | None) -> None:
    monkeypatch.setattr(distributed.deepspeed, "offload_adam", lambda *a, **k: None)
    accelerator = types.SimpleNamespace(device=torch.device(device))
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(accelerator, params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is fused
