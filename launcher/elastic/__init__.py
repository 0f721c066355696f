"""The job's processes, through torch's elastic engine: the launcher's `LocalElasticAgent` (`agent`), where the nodes
of one job meet (`rendezvous`), and what is said when workers fail, one line per failing rank by its cause
(`failures`). The parent starts it (`launcher.parent.workers`); nothing here imports the parent.
"""
