"""Checkpoints: the manager (commit, rotation, integrity, resume checks and restore, the portable LoRA state and the
final save), and the read lease that keeps a checkpoint being read from rotation."""
