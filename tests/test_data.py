"""The batch contract and the built-in data: which samples a step sees depends on seed and global batch only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from launcher.config import schema
from launcher.config.context import preset_dataset
from launcher.data.builtin import GlobalBatches, rank_micro_batches

schema.register()  # the data groups' schemas, for preset_dataset


@pytest.mark.unit
@pytest.mark.parametrize("world_size,accumulation", [(1, 1), (1, 4), (2, 2), (4, 1), (2, 4)])
def test_every_step_sees_the_same_samples_whatever_g_and_k(world_size: int, accumulation: int) -> None:
    batches = GlobalBatches(num_samples=1000, global_size=32, seed=7)
    for step in (0, 1, 30, 31, 32):  # 31 * 32 crosses an epoch boundary
        indices = batches.at(step * 32)
        parts = [m for r in range(world_size) for m in rank_micro_batches(indices, r, world_size, accumulation)]
        assert len(parts) == world_size * accumulation
        assert {len(p) for p in parts} == {32 // (world_size * accumulation)}
        assert np.array_equal(np.concatenate(parts), indices)
    assert np.array_equal(GlobalBatches(1000, 32, 7).at(160), batches.at(160))
    assert not np.array_equal(GlobalBatches(1000, 32, 8).at(160), batches.at(160))


@pytest.mark.unit
def test_an_epoch_visits_every_sample_once() -> None:
    batches = GlobalBatches(num_samples=96, global_size=32, seed=1)
    epoch = np.concatenate([batches.at(32 * s) for s in range(3)])
    assert sorted(epoch.tolist()) == list(range(96))
    assert not np.array_equal(np.concatenate([batches.at(32 * s) for s in range(3, 6)]), epoch)  # reshuffled


@pytest.mark.unit
def test_pysource_is_the_standard_library_split_without_overlap() -> None:
    train, val = preset_dataset("pysource", "train", seq_len=64), preset_dataset("pysource", "val", seq_len=64)
    assert len(train) > 10 * len(val) > 0  # about 5% of the files, by hash of their path
    x, y = train[3]
    assert x.dtype == torch.int64 and x.shape == (64,) and torch.equal(x[1:], y[:-1])
    text = bytes(train.tokens[:100_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert bytes(train.tokens[:4096]) not in bytes(val.tokens)


@pytest.mark.unit
def test_tokens_reads_a_memory_mapped_file(tmp_path) -> None:
    ids = np.arange(10_000, dtype=np.uint32) * 7 % 70_000
    ids.tofile(tmp_path / "t.bin")
    train = preset_dataset(
        "tokens", "train", path=str(tmp_path / "t.bin"), dtype="uint32", seq_len=100, val_fraction=0.1
    )
    val = preset_dataset("tokens", "val", path=str(tmp_path / "t.bin"), dtype="uint32", seq_len=100, val_fraction=0.1)
    x, y = train[0]
    assert x.tolist() == ids[:100].tolist() and y.tolist() == ids[1:101].tolist()
    assert val[0][0].tolist() == ids[9000:9100].tolist()


@pytest.mark.unit
def test_synthetic_is_fixed_and_in_range() -> None:
    a, b = (
        preset_dataset("synthetic", "train", seq_len=16, vocab_size=50, num_samples=64),
        preset_dataset("synthetic", "train", seq_len=16, vocab_size=50, num_samples=64),
    )
    assert torch.equal(a[5][0], b[5][0]) and int(a[5][0].max()) < 50


@pytest.mark.unit
def test_unpacked_pysource_pads_the_last_chunk_of_each_document() -> None:
    packed, padded = (
        preset_dataset("pysource", "train", seq_len=32),
        preset_dataset("pysource", "train", seq_len=32, packing=False),
    )
    assert bytes(packed.tokens[:1000]) == bytes(padded.tokens[:1000])  # the same bytes, cut differently
    counts = [int((padded[i][1] != -100).sum()) for i in range(0, 20000, 7)]
    assert min(counts) < 32 == max(counts)  # samples hold different numbers of targets
    x, y = next(padded[i] for i in range(len(padded)) if (padded[i][1] == -100).any())
    real = int((y != -100).sum())
    assert (y[real:] == -100).all() and (x[real + 1 :] == 0).all() and torch.equal(x[1 : real + 1], y[:real])
    hf = preset_dataset("pysource", "train", seq_len=32, packing=False, format="hf")
    row = hf[int(np.flatnonzero([(padded[i][1] == -100).any() for i in range(2000)])[0])]
    assert torch.equal(row["labels"][row["labels"] != -100], row["input_ids"][: int((row["labels"] != -100).sum())])


@pytest.mark.unit
def test_the_loader_reads_the_same_batches_in_the_same_order_with_workers() -> None:
    from launcher.checkpoint.format import Position
    from launcher.data.collate import default_collate
    from launcher.data.sources import RandomAccess, Reading

    source = RandomAccess(preset_dataset("synthetic", "train", seq_len=16, num_samples=256), 32, 3, default_collate)

    def read(start: int, steps: int, workers: int) -> list[torch.Tensor]:
        fed = source.feed(Position(start // 32, start), steps, Reading(1, 2, 2, workers))
        return [x for step in fed for x, _ in step.micro]

    inline, ahead = read(0, 12, 0), read(0, 12, 2)
    assert len(inline) == 24 and all(torch.equal(a, b) for a, b in zip(inline, ahead, strict=True))
    resumed = read(5 * 32, 7, 2)  # from step 6 on, as a resumed run reads them
    assert all(torch.equal(a, b) for a, b in zip(resumed, inline[10:], strict=True))
