"""Recovery and adaptation, in one room: the memory tier of checkpoints (what a node's folder in shared memory holds,
its plan figures and its checks: `shm`; the launcher's side, the node folder it makes and removes: `node`; the
workers' side: `tier`), and runs that adapt without changing their result: the micro-batch an out-of-memory error
halves and the world size an elastic job's nodes set (`adapt`).

May import: `launcher.base`, `launcher.config`, `launcher.checkpoint`, `strategies`; never the worker's or parent's
modules.
"""
