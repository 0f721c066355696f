"""The loggers rank 0 writes to, in one room: the fan-out over several loggers, the JSONL metrics file and how an
attempt ends them (`base`), Weights & Biases (`wandb`), MLflow (`mlflow`, its tracking store `mlflow_store`),
TensorBoard (`tensorboard`), the progress line (`progress`), and their checks before start (`checks`, called by the
parent; the sweep's MLflow parent run is `mlflow_store`'s too).

May import: `launcher.base`, `launcher.config`; wandb, mlflow and tensorboard lazily; never the worker's or parent's
modules.
"""
