"""Metrics: the run's log (metrics.jsonl), the throughput meter, trackers, and the plots drawn from the log."""
