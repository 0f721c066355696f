"""Evaluation, in one room: the validation passes that count each sample once (`passes`), the metrics of the
user's choice reduced exactly over ranks (`metrics`), the user's callbacks and the early stop (`callbacks`), and their
checks before start, with `launch eval`'s (`checks`, called by the parent).

May import: `launcher.base`, `launcher.config`, `launcher.data`, `launcher.models`, `launcher.checkpoint`,
`strategies`; never the worker's or parent's modules.
"""
