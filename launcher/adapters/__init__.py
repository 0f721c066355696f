"""Adapters: the one module per library that holds every name of that library's which is not its public API, names
the release it was checked against and checks those names before they are relied on (`strategies.checked`).

- `torch_private`: torch's (the elastic agent's hooks, the dynamic rendezvous, `UntypedStorage.resize_`);
- DeepSpeed's is `strategies.deepspeed.zero` (a strategy imports nothing of the launcher).

Runs in: both (the parent's agent and rendezvous, the worker's memory figures).
May import: the standard library, torch (lazily), `strategies.checked`; nothing of `launcher`.
"""
