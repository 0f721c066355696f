"""Recovery from failures: the memory tier's node folders in shared memory (what a launcher leaves behind and what the
next one on the host removes), what the tier copies per strategy, and the checks of both before start."""
