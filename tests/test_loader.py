"""TensorLoader: shards, shuffles, augmentation, normalisation."""

import pytest
import torch
import torch.nn.functional as F

from lab_utils.loader import TensorLoader, random_crop, random_flip


def labelled(n: int, shape=(1, 4, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose every pixel holds the sample's index (mod 256), labels = index."""
    x = (torch.arange(n) % 256).to(torch.uint8).reshape(n, 1, 1, 1).expand(n, *shape).contiguous()
    return x, torch.arange(n)


def labels_seen(loader: TensorLoader) -> list[int]:
    return [int(i) for _, yb in loader for i in yb]


@pytest.mark.parametrize("n, world", [(10, 3), (17, 4), (5, 2), (3, 4)])
def test_even_shards_give_every_rank_the_same_batches_and_cover_the_data(n, world):
    x, y = labelled(n)
    loaders = [TensorLoader(x, y, 2, rank=r, world_size=world, seed=1) for r in range(world)]
    assert len({len(ld) for ld in loaders}) == 1
    seen = [labels_seen(ld) for ld in loaders]
    assert len({len(s) for s in seen}) == 1
    assert sum(len(s) for s in seen) == -(-n // world) * world  # padded to a multiple
    assert set().union(*map(set, seen)) == set(range(n))


@pytest.mark.parametrize("shuffle", [True, False])
def test_uneven_shards_partition_the_data_exactly(shuffle):
    n, world = 11, 3
    x, y = labelled(n)
    seen = [
        labels_seen(
            TensorLoader(x, y, 4, rank=r, world_size=world, shuffle=shuffle, even_shards=False)
        )
        for r in range(world)
    ]
    flat = sorted(i for s in seen for i in s)
    assert flat == list(range(n))  # every sample exactly once
    assert [len(s) for s in seen] == [4, 4, 3]


def test_more_ranks_than_samples_leaves_an_evaluation_shard_empty():
    x, y = labelled(2)
    assert [
        len(TensorLoader(x, y, 4, rank=r, world_size=3, even_shards=False)) for r in range(3)
    ] == [1, 1, 0]
    assert labels_seen(TensorLoader(x, y, 4, rank=2, world_size=3, even_shards=False)) == []


def test_unshuffled_uneven_shard_is_rank_strided():
    x, y = labelled(10)
    assert labels_seen(
        TensorLoader(x, y, 3, rank=1, world_size=3, shuffle=False, even_shards=False)
    ) == [1, 4, 7]


def test_epochs_reshuffle_reproducibly_and_ranks_agree():
    x, y = labelled(50)
    a = TensorLoader(x, y, 7, seed=3)
    b = TensorLoader(x, y, 7, seed=3)
    first = labels_seen(a)
    a.set_epoch(1)
    second = labels_seen(a)
    assert first != second and sorted(first) == sorted(second) == list(range(50))
    b.set_epoch(1)
    assert labels_seen(b) == second
    a.set_epoch(0)
    assert labels_seen(a) == first
    assert labels_seen(TensorLoader(x, y, 7, seed=4)) != first
    # Two ranks shard the same permutation: together they see each sample once.
    r0, r1 = (TensorLoader(x, y, 5, seed=3, rank=r, world_size=2) for r in (0, 1))
    assert sorted(labels_seen(r0) + labels_seen(r1)) == list(range(50))


def test_drop_last_and_len():
    x, y = labelled(10)
    assert len(TensorLoader(x, y, 4)) == 3
    kept = TensorLoader(x, y, 4, drop_last=True)
    assert len(kept) == 2 and [len(yb) for _, yb in kept] == [4, 4]
    with pytest.raises(ValueError, match="no batches"):
        TensorLoader(x, y, 20, drop_last=True)


def test_normalisation_matches_formula_and_dtype():
    x = torch.randint(0, 256, (6, 3, 5, 5), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    xb, _ = next(iter(TensorLoader(x, torch.zeros(6), 6, shuffle=False, mean=mean, std=std)))
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    assert xb.dtype == torch.float32
    torch.testing.assert_close(xb, expected)
    plain, _ = next(iter(TensorLoader(x, torch.zeros(6), 6, shuffle=False)))
    torch.testing.assert_close(plain, x.float() / 255)
    with pytest.raises(ValueError, match="3 entries"):
        TensorLoader(x, torch.zeros(6), 2, mean=(0.5,), std=(0.2,))


def test_float_features_pass_through():
    x = torch.randn(8, 3)
    xb, _ = next(iter(TensorLoader(x, torch.zeros(8), 8, shuffle=False)))
    torch.testing.assert_close(xb, x)
    assert x.data_ptr() != xb.data_ptr()


def test_device_and_channels_last_are_honoured():
    x, y = labelled(8, shape=(3, 6, 6))
    loader = TensorLoader(x, y, 4, device="cpu", channels_last=True, augment=True)
    xb, yb = next(iter(loader))
    assert xb.device == x.device == yb.device == loader.x.device
    assert xb.is_contiguous(memory_format=torch.channels_last)


def test_from_dataset_defaults():
    from lab_utils.data import Dataset

    x, y = labelled(9)
    ds = Dataset("toy", x, y, x[:5], y[:5], ("a",), (0.5,), (0.25,), "memory")
    train = TensorLoader.from_dataset(ds, "train", 4)
    test = TensorLoader.from_dataset(ds, "test", 2, world_size=2, rank=1)
    assert train.shuffle and not test.shuffle and not test.even_shards
    assert labels_seen(test) == [1, 3]
    torch.testing.assert_close(
        next(iter(test))[0][0, 0, 0, 0], torch.tensor((1 / 255 - 0.5) / 0.25)
    )
    with pytest.raises(ValueError, match="split"):
        TensorLoader.from_dataset(ds, "valid", 4)


def test_bad_arguments_are_refused():
    x, y = labelled(4)
    with pytest.raises(ValueError, match="rank"):
        TensorLoader(x, y, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="same"):
        TensorLoader(x, y[:3], 2)
    with pytest.raises(ValueError, match="both"):
        TensorLoader(x, y, 2, mean=(0.5,))


# --------------------------------------------------------------------------- augmentation
def test_random_crop_equals_pad_then_crop():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    for mode, torch_mode in (("reflect", "reflect"), ("zeros", "constant")):
        gen = torch.Generator().manual_seed(5)
        out = random_crop(x, 2, padding_mode=mode, generator=gen)
        shift = torch.randint(0, 5, (2, 64), generator=torch.Generator().manual_seed(5))
        padded = F.pad(x.float(), (2, 2, 2, 2), mode=torch_mode).to(torch.uint8)
        for i in range(64):
            dy, dx = shift[:, i].tolist()
            assert torch.equal(out[i], padded[i, :, dy : dy + 8, dx : dx + 8]), (mode, i)
    assert out.dtype == torch.uint8 and out.shape == x.shape


def test_random_crop_moves_exactly_the_images_with_a_nonzero_offset():
    x = torch.randint(0, 256, (100, 1, 8, 8), dtype=torch.uint8)
    out = random_crop(x, 2, generator=torch.Generator().manual_seed(1))
    shift = torch.randint(0, 5, (2, 100), generator=torch.Generator().manual_seed(1)) - 2
    moved = torch.tensor([not torch.equal(out[i], x[i]) for i in range(100)])
    assert torch.equal(moved, shift.ne(0).any(0))
    assert int(moved.sum()) > 80  # 24 of the 25 offsets move the image
    assert random_crop(x, 0) is x
    with pytest.raises(ValueError, match="pad"):
        random_crop(x, 8)


def test_random_flip_flips_about_half_and_nothing_else():
    x = torch.randint(0, 256, (200, 3, 5, 7), dtype=torch.uint8)
    out = random_flip(x, generator=torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(out[i], x[i].flip(2)) for i in range(200)])
    kept = torch.tensor([torch.equal(out[i], x[i]) for i in range(200)])
    assert bool((flipped | kept).all())
    assert 70 < int(flipped.sum()) < 130


def test_augmentation_uses_global_rng_so_seeding_reproduces_it():
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    torch.manual_seed(7)
    a = random_flip(random_crop(x, 2))
    torch.manual_seed(7)
    b = random_flip(random_crop(x, 2))
    assert torch.equal(a, b)
    torch.manual_seed(8)
    assert not torch.equal(a, random_flip(random_crop(x, 2)))  # the seed does steer it


def test_loader_augments_only_when_asked():
    x, y = labelled(16, shape=(1, 6, 6))
    x = torch.randint(0, 256, x.shape, dtype=torch.uint8)
    plain = torch.cat([xb for xb, _ in TensorLoader(x, y, 16, shuffle=False)])
    torch.testing.assert_close(plain, x.float() / 255)
    torch.manual_seed(0)
    augmented = torch.cat([xb for xb, _ in TensorLoader(x, y, 16, shuffle=False, augment=True)])
    assert not torch.equal(augmented, plain)
    calls = []
    custom = TensorLoader(x, y, 8, augment=lambda b: calls.append(len(b)) or b)
    list(custom)
    assert calls == [8, 8]
