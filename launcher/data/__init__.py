"""The data: the built-in datasets and the global-batch sampler (`builtin`), the batch contract over any source of
samples, random access or a stream (`sources`), a rank's micro-batches and moving them to the device (`collate`), and
the data options that read your files: data=text (`text`, built by `text_build`, its tokenizer `tokenizer`), data=hf
(`hf`), data=store (`store`, built by `launch prepare`: `launcher.prepare`), and the launcher's checks of the data
before any worker starts (`checks`); data=mix, a weighted mixture of any of them, is `launcher.mixture`'s. Each data
target is called with `split="train"` or `split="val"` and its own keys; the parent builds each split once to check
it, every worker builds its own.

May import: `launcher.base` (errors, locations, checksums), `torch`, and `datasets`, `transformers`, `fsspec` lazily;
never the config's, models', worker's or parent's modules.

The built-in targets keep their names here: `launcher.data.PySource`, `launcher.data.Synthetic`, `launcher.data.Tokens`.
"""

from launcher.data.builtin import PySource, Synthetic, Tokens

__all__ = ["PySource", "Synthetic", "Tokens"]
