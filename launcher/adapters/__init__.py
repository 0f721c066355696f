"""Adapters: the one module per library that holds every name of that library's which is not its public API, names
the release it was checked against and checks those names before they are relied on (`strategies.checked`).

- `torch_private`: torch's (the elastic agent's hooks, the dynamic rendezvous, `UntypedStorage.resize_`);
- `optuna_private`: optuna's (a sampler's `Study.stop()` outside `optimize`);
- `transformers_private`: transformers' (`from_pretrained` building a model from its config alone, on meta);
- DeepSpeed's is `strategies.deepspeed.zero` (a strategy imports nothing of the launcher).

Runs in: both (the parent's agent, rendezvous, model on meta and sweeper; the worker's memory figures).
May import: the standard library, its library (lazily), `strategies.checked`; nothing of `launcher`.
"""
