"""`launch plan` and `strategy=auto`: per-rank memory and communication of a run, before it starts.

It answers what a user asks before a run — will it fit, how long will the gradient sync take, what is my
effective batch — from the same frozen config the run would use, in four modules that change apart:

- `costs`: pure arithmetic over plain numbers (bytes per parameter, ring collectives, FLOPs, activations);
- `fit`: that arithmetic applied to a config: the plan of each strategy's `layout()`, the fit test, and the
  search for what would fit;
- `render`: the table, the JSON and the chart;
- `commands`: the entry points, `main` (`launch plan`) and `choose` (`strategy=auto`).

Importing this package imports nothing; `costs` imports no torch.
"""
