"""Reading what a strategy wrote, offline: full weights of a checkpoint from any strategy, and the non-tensor types
its pickles may hold (numpy RNG states, DeepSpeed's ZeRO bookkeeping)."""

from __future__ import annotations

from typing import Any

import torch


def checkpoint_safe_globals() -> list[Any]:
    """Non-tensor types that checkpoints of our strategies legitimately pickle: numpy RNG states (accelerate)
    and DeepSpeed's ZeRO stage enum. Anything else in a checkpoint is refused."""
    import numpy as np

    allowed: list[Any] = [np.ndarray, np.dtype, np._core.multiarray._reconstruct,
                          type(np.dtype(np.uint32)), type(np.dtype(np.float64)), type(np.dtype(np.int64))]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    return allowed


def consolidate_full_weights(ckpt: Any, strategy: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a full fine-tuning checkpoint, whatever strategy wrote it (offline, one process).

    Call `checkpoint.verify_checkpoint_files` first: DeepSpeed's and DCP's readers unpickle without restriction.
    """
    from pathlib import Path

    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if strategy.startswith("zero"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # accelerate's save_state writes DeepSpeed's 'latest' next to the 'pytorch_model' tag directory
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    if strategy.startswith("fsdp"):
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt / "pytorch_model_fsdp_0", Path(tmp) / "model.pt")
            return torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=True)
    return load_file(ckpt / "model.safetensors")
