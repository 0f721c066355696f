"""DeepSpeed, imported once per process without what its import pulls in for a feature the launcher does not use:
its autotuner imports MLflow where MLflow is installed (`launch[mlflow]`), about 0.9 s of every DeepSpeed run's start.
`import strategies.deepspeed.imported` before any `import deepspeed`; MLflow imports as usual afterwards (a run that
logs to it imports it then). Also imported: DeepSpeed's Muon, which every ZeRO optimizer's constructor imports (and
with it torch's inductor, about 1 s): the launcher imports both before it forks CPU workers (`Requirements.imports`),
so that no rank pays for them."""

from __future__ import annotations

import sys

if "deepspeed" not in sys.modules:
    _blocked = "mlflow" not in sys.modules
    if _blocked:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed  # noqa: F401
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        if _blocked and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
