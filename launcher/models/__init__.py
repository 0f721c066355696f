"""Models and the model contract: the built-in GPT (`gpt`), a model built on the meta device once in the parent for
every check and plan, and what the workers need of it (`meta`), and how a forward's loss is read and a step's loss
made from it (`loss`: the loss contract), and the launcher's checks of it before any worker starts (`checks`). Any
model works if its forward takes a batch and returns the loss.

May import: `launcher.base`, `launcher.config`, `launcher.adapters`, `strategies` (a model called as the strategies
call it, its MoE blocks), `torch`; `transformers` lazily.
"""
