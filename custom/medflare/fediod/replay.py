"""The server's bank of past generated inputs and their ensemble logits, which the student replays (no FLARE).

Algorithm 1 trains the student S once per generated batch, on that batch. Every batch costs the sites a
round of teacher and discriminator evaluations and two messages, while S's step costs the server a few
milliseconds, so in a run of a few hundred steps S sees too few inputs: on the CPU presets' data it stays
near chance although it fits each batch (benchmarks/RESULTS_fediod.md, "Replaying past generated batches").

The data-free distillation literature keeps a pool of the generator's past samples for the student
(the "data pool" of Fang et al., Contrastive Model Inversion, IJCAI 2021, and Fast Data-Free KD, AAAI 2022).
Here the pool holds each generated input with the ensemble logits A(x) (Eq. 9) the server formed from the
sites' answers for it: the teachers are frozen, so T_k(x) stays their answer for x (A's discriminator
factor is that of the window it came from). Nothing new leaves a site: the bank holds only the generator's
own outputs and what the sites already released through their filters and privacy settings, so further
student steps on it are post-processing of released values and spend no privacy budget.

Not in the paper (``fediod.student_steps`` = 1, the default, is Algorithm 1). The bank keeps the newest
``capacity`` inputs; draws come from their own random stream so G's noise stream is unchanged.
"""

from __future__ import annotations

import torch


class ReplayBank:
    """The newest ``capacity`` (input, target) pairs, and random batches of them.

    Args:
        capacity: inputs kept (oldest dropped first); >= 1.
        seed: seed of the draws.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"replay bank capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.rng = torch.Generator().manual_seed(int(seed))
        self.x: torch.Tensor | None = None
        self.target: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.x is None else len(self.x)

    def add(self, x: torch.Tensor, target: torch.Tensor) -> None:
        """Keep a batch (detached); the oldest entries beyond ``capacity`` are dropped."""
        if len(x) != len(target):
            raise ValueError(f"inputs ({len(x)}) and targets ({len(target)}) must pair up")
        x, target = x.detach(), target.detach()
        if self.x is not None:  # in the order they came, oldest first
            x, target = torch.cat([self.x, x]), torch.cat([self.target, target])
        self.x, self.target = x[-self.capacity:], target[-self.capacity:]

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` pairs drawn uniformly with replacement."""
        if self.x is None:
            raise ValueError("the replay bank is empty")
        idx = torch.randint(len(self.x), (int(n),), generator=self.rng).to(self.x.device)
        return self.x[idx], self.target[idx]


__all__ = ["ReplayBank"]
