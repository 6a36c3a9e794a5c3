"""The curriculum: the stages in order, their lengths, LR schedules, pacing and gates, and the samples each step
draws (sampling)."""
