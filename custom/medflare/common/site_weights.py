"""Aggregation weights the server stands behind, not a site's word: the one rule every averaging workflow uses.

FedAvg weighs each site's update by the count it reports (FLARE's ``NUM_STEPS_CURRENT_ROUND``; our sites report
their training cases). Taken at face value, one site claiming 1e9 cases owns the global model (issue 28: a
sign-flipped update claiming 1e9 steps took the global Dice from 71.7 to 5.9), and 1e300 overflows float32 into a
NaN model. :class:`SiteWeights` turns reports into weights the server can defend:

- **declared count**: the first count a site reports for a task is its declared size; a later report above it is
  clipped to it (a hospital's training set does not grow mid-job; fewer steps in a round are taken as they are);
- **peer cap**: no site weighs more than ``max_ratio`` times the median of the *other* sites' declared counts (a
  site's own claim never enters its own cap, so one liar cannot raise it; with a single site there is no cap).
  Real hospitals differ in size, hence a ratio and not equal weights; 10 lets a hospital ten times the typical
  one count ten times, and bounds a liar's first-round claim to that;
- **refused**: a count that is not a finite number > 0 (NaN, Inf, a string, a bool, 0, negative) refuses that
  site's result for the round; no count at all weighs 1 (FLARE's own default).

Plain python and numpy, no FLARE: :class:`medflare.baselines.controller.ResilientFedAvg` / ``ResilientScaffold`` and
:class:`medflare.common.workflow.SiteRounds` (FedSM, FedST, ...) call :meth:`SiteWeights.bound` once per round
and log what it says; the unit tests call it with hand-made reports.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

#: default of ``max_ratio``: a site weighs at most this many times the median of its peers' declared counts
MAX_WEIGHT_RATIO = 10.0


@dataclass
class RoundWeights:
    """What :meth:`SiteWeights.bound` decided for one round.

    weights: ``{site: weight}`` of the sites whose result may be aggregated; clipped: ``{site: why}`` of those whose
    report was lowered; refused: ``{site: why}`` of those whose report is no count (their result must not be used).
    """

    weights: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def reported_count(value: Any) -> float | None:
    """A reported count as a float > 0, or None when it is not one (bool, non-number, NaN/Inf, <= 0). Absent = 1."""
    if value is None:
        return 1.0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    try:
        count = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return count if math.isfinite(count) and count > 0 else None


class SiteWeights:
    """The server's weight of each site, round by round (see the module docstring); one instance per task.

    Args:
        max_ratio: a site weighs at most ``max_ratio`` x the median of the other sites' declared counts; must be
            >= 1. Default :data:`MAX_WEIGHT_RATIO`.
        what: what the weights are for, named in the messages (e.g. "FedAvg 'train'"). Default "aggregation".
    """

    def __init__(self, max_ratio: float = MAX_WEIGHT_RATIO, what: str = "aggregation"):
        if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not max_ratio >= 1:
            raise ValueError(f"SiteWeights: 'max_ratio' must be a number >= 1, got {max_ratio!r}")
        self.max_ratio = float(max_ratio)
        self.what = what
        self.declared: dict[str, float] = {}
        self._lock = threading.Lock()

    def cap(self, site: str) -> float:
        """``max_ratio`` x the median of the other sites' declared counts (inf when no other site declared one)."""
        others = [n for s, n in self.declared.items() if s != site]
        return self.max_ratio * statistics.median(others) if others else math.inf

    def bound(self, reports: Mapping[str, Any]) -> RoundWeights:
        """The weights of one round's answering sites from their reported counts ``{site: count or None}``.

        A site's first valid report declares its count (all of this round's first reports are declared before any
        cap is computed, so the order results arrive in does not matter).
        """
        out = RoundWeights()
        with self._lock:
            counts = {}
            for site, value in reports.items():
                count = reported_count(value)
                if count is None:
                    out.refused[site] = (f"reported {value!r} as its count ({self.what}); a count must be a finite number > 0")
                    continue
                counts[site] = count
                self.declared.setdefault(site, count)
            for site, count in counts.items():
                weight = min(count, self.declared[site], self.cap(site))
                if weight < count:
                    out.clipped[site] = (f"reported {count:.6g} as its count ({self.what}), weighed as {weight:.6g} "
                                         f"(its declared count {self.declared[site]:.6g}, at most {self.max_ratio:g} x the "
                                         "median of the other sites' declared counts)")
                out.weights[site] = weight
        return out
