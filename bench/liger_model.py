"""train_curriculum.py with Liger-Kernel's fused Qwen3 layers (RMSNorm, RoPE, SwiGLU) patched in before the model
is built: bench/gpu_qwen3_8b.py's `liger_model` variant, which measures what they would lift before the toolkit
offers them as a recipe key. The loss head stays the recipe's (`model.loss_head`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from liger_kernel.transformers import apply_liger_kernel_to_qwen3

import train_curriculum

if __name__ == "__main__":
    apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False)
    sys.exit(train_curriculum.main())
