"""What every side of a run uses, and which imports nothing else of the launcher: the launcher's errors (`errors`),
durable writes (`durable`), local folders and fsspec URLs as one kind of location, with URLs masked when named
(`storage`), xxh3 checksums (`hashing`), the machine's GPUs, memory and CPUs (`machine`), and locating a `_target_`
(`targets`).

May import: the standard library and third-party packages, lazily where they are heavy; nothing of `launcher`.
"""
