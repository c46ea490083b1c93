"""The server's replay bank (medflare.fediod.replay): bounded, the newest inputs kept, each with its own target,
reproducible draws. The student's steps on it are tested with the protocol (tests/unit/test_fediod_protocol.py)."""

import pytest
import torch

from medflare.fediod.replay import ReplayBank


def test_bank_keeps_the_newest_pairs_up_to_its_capacity():
    bank = ReplayBank(5, seed=0)
    for start in (0, 3, 6):  # batches of 3 inputs labelled by their index
        x = torch.arange(start, start + 3, dtype=torch.float32).reshape(3, 1)
        bank.add(x, -x)
    assert len(bank) == 5
    assert sorted(bank.x.reshape(-1).tolist()) == [4.0, 5.0, 6.0, 7.0, 8.0]
    xs, ts, ls = bank.draw(50)
    assert xs.shape == (50, 1) and torch.equal(ts, -xs) and ls is None  # a draw keeps each input with its own target
    assert set(xs.reshape(-1).tolist()) <= {4.0, 5.0, 6.0, 7.0, 8.0}
    assert bank.x.reshape(-1).tolist() == [4.0, 5.0, 6.0, 7.0, 8.0]  # oldest first across the ring's wrap
    small = ReplayBank(2)
    small.add(torch.arange(3.0).reshape(3, 1), torch.arange(3.0).reshape(3, 1))  # a batch larger than the bank
    assert small.x.reshape(-1).tolist() == [1.0, 2.0] and torch.equal(small.target, small.x)


def test_bank_draws_are_reproducible_and_checked():
    a, b = ReplayBank(4, seed=1), ReplayBank(4, seed=1)
    for bank in (a, b):
        bank.add(torch.arange(4.0).reshape(4, 1), torch.zeros(4, 2))
    assert torch.equal(a.draw(8)[0], b.draw(8)[0])
    with pytest.raises(ValueError):
        ReplayBank(0)
    with pytest.raises(ValueError):
        ReplayBank(3).draw(2)
    with pytest.raises(ValueError):
        ReplayBank(3).add(torch.zeros(2, 1), torch.zeros(3, 1))


def test_bank_keeps_label_maps_with_their_inputs():
    """Segmentation with the student's label term: each draw returns an input's own label map as a third tensor; a bank
    holds labels for every entry or for none."""
    bank = ReplayBank(6, seed=2)
    for start in (0, 4):
        x = torch.arange(start, start + 4, dtype=torch.float32).reshape(4, 1)
        bank.add(x, 2 * x, x.long() + 100)
    xs, ts, ls = bank.draw(40)
    assert torch.equal(ts, 2 * xs) and torch.equal(ls, xs.long() + 100)
    with pytest.raises(ValueError, match="labels"):
        bank.add(torch.zeros(1, 1), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="labels"):
        ReplayBank(3).add(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(3, 1))
