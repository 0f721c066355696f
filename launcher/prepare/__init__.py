"""`launch prepare`: the data made ready before any run reads it, on one machine or many: a token store for
data=store (`store`), built from data=text's files and tokenizer, shard by shard, resumable.

May import `launcher.data` (what it builds and from what) and `launcher.base`; nothing but the parent's command
imports it.
"""
