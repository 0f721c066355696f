"""launch: one command trains a PyTorch model under any data-parallel strategy.

The packages, by side, each one's `__init__` saying what it owns and what it may import; imports point down this
list, never up, with no circle:

- `parent`: the process that checks and starts a job, one per node (the console script, the checks, the agent);
- `worker`: the process that trains, one per rank (the runner and its phases, the step, the loggers);
- `clusters`, `search`, `plan`: where a job runs, sweeps that search, the planner;
- `checkpoint`: what a checkpoint is, saving and loading it;
- `models`: the built-in GPT and the model contract (the meta-device build, the loss);
- `config`: the typed config, frozen and derived once;
- `data`: the built-in data, the batch contract over any source, the collate, text, Hugging Face datasets, stores;
- `base`: what every side uses (errors, durable writes, locations, checksums, the machine).

`strategies/`, beside this package, wraps a model for a parallel layout and imports nothing of it.
"""
