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

    A ring buffer allocated at the first :meth:`add` (the server adds a batch every step, so the bank is not
    copied as it grows); :attr:`x` / :attr:`target` and the draws see the entries oldest first.

    Args:
        capacity: inputs kept (oldest dropped first); >= 1.
        seed: seed of the draws.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 1:
            raise ValueError(f"replay bank capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.rng = torch.Generator().manual_seed(int(seed))
        self._x: torch.Tensor | None = None
        self._target: torch.Tensor | None = None
        self._label: torch.Tensor | None = None
        self._size = 0  # entries held
        self._next = 0  # slot the next entry goes to (the oldest one once the bank is full)

    def __len__(self) -> int:
        return self._size

    def _order(self) -> torch.Tensor:
        """Slots of the entries, oldest first."""
        start = self._next if self._size == self.capacity else 0
        return (start + torch.arange(self._size)) % self.capacity

    @property
    def x(self) -> torch.Tensor | None:
        """The inputs held, oldest first (None while empty)."""
        return None if self._x is None else self._x[self._order().to(self._x.device)]

    @property
    def target(self) -> torch.Tensor | None:
        """The targets of :attr:`x`, in the same order."""
        return None if self._target is None else self._target[self._order().to(self._target.device)]

    def add(self, x: torch.Tensor, target: torch.Tensor, label: torch.Tensor | None = None) -> None:
        """Keep a batch (detached), with the label maps that conditioned it when given (then always: a bank holds
        labels for every entry or for none); the oldest entries beyond ``capacity`` are dropped."""
        if len(x) != len(target) or (label is not None and len(label) != len(x)):
            raise ValueError(f"inputs ({len(x)}), targets ({len(target)}) and labels must pair up")
        if self._x is not None and (label is None) != (self._label is None):
            raise ValueError("a replay bank holds labels for every entry or for none")
        x, target = x.detach()[-self.capacity:], target.detach()[-self.capacity:]
        if self._x is None:
            self._x = x.new_empty((self.capacity, *x.shape[1:]))
            self._target = target.new_empty((self.capacity, *target.shape[1:]))
            if label is not None:
                self._label = label.new_empty((self.capacity, *label.shape[1:]))
        slots = (self._next + torch.arange(len(x))) % self.capacity
        self._x[slots.to(x.device)], self._target[slots.to(target.device)] = x, target
        if label is not None:
            self._label[slots.to(label.device)] = label.detach()[-self.capacity:]
        self._next = int(slots[-1] + 1) % self.capacity
        self._size = min(self._size + len(x), self.capacity)

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``n`` entries drawn uniformly with replacement: (inputs, targets, label maps or None when the bank holds
        none)."""
        if self._size == 0:
            raise ValueError("the replay bank is empty")
        idx = torch.randint(self._size, (int(n),), generator=self.rng)
        slots = self._order()[idx].to(self._x.device)
        return self._x[slots], self._target[slots], None if self._label is None else self._label[slots]


__all__ = ["ReplayBank"]
