"""What a run measures of itself, in one room: the peak memory of a step (`peak_memory`), step time, throughput and
MFU against the plan (`speed`), stragglers named (`stragglers`), and the profiler and memory snapshots
(`profiling`).

May import: `launcher.base`, `launcher.config`, `launcher.plan` (its cost arithmetic), `strategies`; never the
worker's or parent's modules.
"""
