"""data=mix, a weighted mixture of sources under the batch contract: the mixture itself and the slots of each step
(`mix`), its weights and their schedules (`weights`), its checks before start and on resume (`checks`), and each
source's loss on a logged step, in the workers (`source_loss`).

May import `launcher.data` (the sources it mixes), `launcher.base` and `launcher.models.loss`; `launcher.data` never
imports it (the parent hands a mixture's check to `launcher.data.checks`).
"""
