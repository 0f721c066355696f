"""Leaving for the ecosystem: a run's model as a transformers folder (`transformers_folder`: the built-in GPT as
GPT-2, with the run's tokenizer) and lm-evaluation-harness on it (`harness`)."""
