"""The model: loading (tokenizer, processor, dtype, LoRA), the attention kernels for packed rows, fused layers, the
loss head, what each stage trains, and the estimates of its memory and FLOPs."""
