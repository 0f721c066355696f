"""What every side of a run uses, and which imports nothing else of the launcher: the launcher's errors (`errors`),
durable writes (`durable`), local folders and fsspec URLs as one kind of location, with URLs masked when named
(`storage`), xxh3 checksums (`hashing`), the machine's GPUs, memory and CPUs (`machine`), locating a `_target_`
(`targets`), a built-in target's settings read from its config node (`settings`), environment variables set for a
while (`environ`), a batch moved to a device (`device`), and every logged figure's declaration (`metrics`: the
runner reduces by it, the sweeper checks an objective against it, the docs list it).

May import: the standard library and third-party packages, lazily where they are heavy; nothing of `launcher`.
"""
