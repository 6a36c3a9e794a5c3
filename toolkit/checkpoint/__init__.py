"""Checkpoints: the manager (commit, rotation, integrity), safe loading, the portable LoRA state, resume checks and
restore, final/ with its model card, and the read lease that keeps a checkpoint being read from rotation."""
