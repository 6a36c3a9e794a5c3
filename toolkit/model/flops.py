"""Model FLOPs of a training step, for model FLOPs utilisation (MFU).

MFU compares the *useful* work of a step with what the hardware could do at its dense bf16 peak, so it is
comparable across strategies, kernels and sequence lengths. The count follows Kaplan et al. 2020 / PaLM
(Chowdhery et al. 2022, appendix B) for a decoder (Llama / Qwen2 / Qwen3 layout: GQA attention, SwiGLU MLP):

    N         = L * P_layer + P_head                   matmul weights; the embedding lookup is no matmul
    P_layer   = h*(a*d) + 2*h*(k*d) + (a*d)*h + 3*h*i   q, k, v, o projections (GQA) + gate, up, down
    P_head    = h*V                                     the LM head costs a matmul even when tied

    dense     = 6*N per token (full fine-tuning: forward 2N, backward 2N for activation gradients and
                2N for weight gradients), or 4*N with LoRA (frozen weights get no weight-gradient matmul;
                the adapters' own FLOPs, ~6*r*(in+out) per adapted matrix, are negligible and ignored)
    attention = 3 * L * (2 * 2 * s * a*d * 1/2) = 6*L*s*a*d per token for a causal sequence of length s:
                QK^T and AV each cost 2*s*(a*d) per token, causality halves it, and the backward pass costs
                twice the forward (both operands need gradients, with or without LoRA)

    flops(sequence of length s) = s * (dense + 6*L*s*a*d)

h hidden size, a attention heads, k key/value heads, d head dim, i MLP size, L layers, V vocabulary. Norms,
rotary embeddings, activations and the softmax are elementwise and left out, as is the recomputation of
gradient checkpointing (not useful work: MFU is defined without it). Padding tokens are not counted, and the LM
head is charged only for the tokens whose logits are computed (`batch_train_flops`' head_tokens: the label tokens
with the chunked or Liger head).
"""

from __future__ import annotations

from typing import Any

from toolkit.model.params import count_params, decoder_config

PEAK_TFLOPS: dict[str, float] = {
    # Dense (no sparsity) bf16 tensor-core peak from the vendor datasheets, per device-name substring.
    # Matched longest key first, so "H100 PCIe" wins over "H100" and "A100" over "A10".
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM (the name reads "NVIDIA H100 80GB HBM3")
    "H200 NVL": 835.0,  # the PCIe card: 1,671 TFLOPS with sparsity, half that dense
    "H200": 989.0,  # SXM
    "A100": 312.0,  # SXM and PCIe alike
    "L40S": 362.0,
    "L40": 181.0,
    "A10G": 125.0,  # AWS's A10 variant; NVIDIA publishes no separate sheet, this is the A10 figure
    "A10": 125.0,
    "RTX 4090": 165.0,  # bf16 with fp32 accumulation, as used in training
}


def attention_flops_per_token(config: Any, seq_len: int) -> float:
    """Causal attention score/value FLOPs per token, forward + backward: 6 * L * s * a * d."""
    c = decoder_config(config)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return 3.0 * int(c.num_hidden_layers) * (2 * 2 * seq_len * heads * head_dim * 0.5)


def train_flops_per_token(config: Any, *, lora: bool, seq_len: int | None = None) -> float:
    """Training FLOPs per token: (4 if lora else 6) * N, plus 6*L*s*a*d when ``seq_len`` is given."""
    dense = (4.0 if lora else 6.0) * count_params(config)["matmul"]
    return dense + (attention_flops_per_token(config, seq_len) if seq_len else 0.0)


def batch_train_flops(config: Any, seq_lens: list[int], *, lora: bool, head_tokens: int | None = None) -> float:
    """Training FLOPs of a batch of real (unpadded) sample lengths; each sample's attention uses its own length.

    ``head_tokens``: the tokens whose logits the loss head computes, charged the LM head's matmul. Default: every
    token (transformers' standard head). The chunked and Liger heads compute logits for label tokens only, so a
    run with a prompt-masked loss is charged the head for its label tokens (the chunked head's recomputation in
    backward is not counted, like checkpointing's)."""
    seq_lens = [n for n in seq_lens if n > 0]
    per_weight = 4.0 if lora else 6.0
    counts = count_params(config)
    body = sum(n * (per_weight * counts["layers"] + attention_flops_per_token(config, n)) for n in seq_lens)
    charged = sum(seq_lens) if head_tokens is None else head_tokens
    return body + charged * per_weight * counts["lm_head"]


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device: the override if given, else the table; None on CPU or unknown."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if not device_name:
        return None
    name = device_name.lower()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


def mfu(flops: float, seconds: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of all devices; None without a known peak."""
    if peak is None or peak <= 0 or seconds <= 0 or num_devices <= 0:
        return None
    return flops / (seconds * num_devices * peak)
