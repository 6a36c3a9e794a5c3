"""The processes of a run: accelerator and process group, signals (preemption, stops), the run folder, and the one
line each rank ends with."""
