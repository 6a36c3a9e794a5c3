"""Training: the step loop, the optimizer and stage freezing, and the stability guard that skips a bad step."""
