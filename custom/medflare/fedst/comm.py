"""Communication cost of FedST-separate vs FedST-join (the paper's Eq. 4 and Fig. 9c), and the job's byte ledger.

Plain Python, no FLARE. G is the bytes of one generator as it travels (FedST-join's in ``diffusion.exchange_dtype``,
float16 halves it; FedST-separate's in float32), S of one segmentation model, c the number of sites,
m the number of rounds in which the join generator is exchanged.

- **separate** (this implementation): whenever the style store is shared, every site uploads its generator
  once (c G) and downloads the c - 1 generators of the others (c (c - 1) G): c^2 G per share. The paper shares
  once; with ``refresh_every`` the store is shared again on every refresh round.
- **join** (this implementation): every generator exchange each site downloads the global generator (FULL) and
  uploads its diff: 2 c G per exchange, 2 c m G in all for m exchanges (``diffusion.sync_steps`` splits a round into
  several exchanges; with ``sync_steps`` 0 an exchange is a round, as in the paper). With ``diffusion.sync_layers``
  "domain" a round of E exchanges moves the whole generator once each way and the domain modulation (D bytes) in its
  other 2 (E - 1) transfers: 2 c (G + (E - 1) D) per round, i.e. m = the rounds and p = (E - 1) per round below.
  With ``diffusion.segmentation_steps`` 0 the generator trains only in the warm-up rounds and the finished one goes
  down once more (c G), with the first ``sample`` task.
- **paper** (Eq. 4): join costs c (2m + 1) G (one more download per site than here: the final model is
  distributed once more), separate c^2 G, so join is cheaper iff 2m + 1 < c, i.e. m < (c - 1) / 2. With this
  implementation's join (no final download) the crossover is m < c / 2.

The segmentation model costs the same in both variants (2 c m S: FULL down, WEIGHT_DIFF up, every round).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medflare import ConfigError


def _check(sites: int, rounds: int, nbytes: int) -> None:
    for key, value, low in (("sites", sites, 1), ("rounds", rounds, 0), ("generator bytes", nbytes, 0)):
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"communication cost: '{key}' must be an int >= {low}, got {value!r}")


def separate_generator_bytes(sites: int, generator_bytes: int, shares: int = 1) -> int:
    """Generator bytes of FedST-separate: c uploads + c (c - 1) downloads per share of the style store."""
    _check(sites, shares, generator_bytes)
    return shares * sites * sites * generator_bytes


def join_generator_bytes(sites: int, rounds: int, generator_bytes: int, partial: int = 0, domain_bytes: int = 0,
                         downloads: int = 0, full_bytes: int | None = None) -> int:
    """Generator bytes of FedST-join as implemented: per site one download and one diff upload of the whole generator
    in each of ``rounds`` exchanges, of the domain modulation alone (``domain_bytes``) in each of ``partial``
    exchanges (``diffusion.sync_layers`` "domain": ``rounds`` = generator rounds, ``partial`` = (E - 1) per round),
    and ``downloads`` downloads of the whole generator alone (``diffusion.segmentation_steps`` 0: the finished one,
    once): 2 c (m G + p D) + c d G.

    ``full_bytes`` (F): the whole generator sent whole where an exchange's transfer is a quantized diff of G bytes
    (``diffusion.exchange_dtype`` "int8" / "int4"): a site's first download is F instead of G, and so is every
    download of the finished generator: 2 c (m G + p D) + c (F - G) + c d F. Default G."""
    full = generator_bytes if full_bytes is None else full_bytes
    _check(sites, rounds, generator_bytes)
    _check(sites, partial, domain_bytes)
    _check(sites, downloads, full)
    first = sites * (full - generator_bytes) if rounds + partial > 0 else 0
    return 2 * sites * (rounds * generator_bytes + partial * domain_bytes) + first + sites * downloads * full


def paper_join_bytes(sites: int, rounds: int, generator_bytes: int) -> int:
    """FedST-join's generator bytes as Eq. 4 counts them: c (2m + 1) G."""
    _check(sites, rounds, generator_bytes)
    return sites * (2 * rounds + 1) * generator_bytes


def eq4_join_cheaper(rounds: int, sites: int) -> bool:
    """Eq. 4: FedST-join communicates less than FedST-separate iff m < (c - 1) / 2."""
    return rounds < (sites - 1) / 2


def segmentation_bytes(sites: int, rounds: int, model_bytes: int) -> int:
    """Segmentation bytes of either variant: FULL down and WEIGHT_DIFF up per site and round."""
    _check(sites, rounds, model_bytes)
    return 2 * sites * rounds * model_bytes


def store_shares(rounds: int, refresh_every: int) -> int:
    """How often FedST-separate shares its style store: once, plus every ``refresh_every`` rounds after round 0."""
    return 1 + ((rounds - 1) // refresh_every if refresh_every > 0 and rounds > 0 else 0)


@dataclass
class Ledger:
    """Bytes each site sent and received per round and task, split into "generator" and "segmentation" parts."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def record(self, rnd: int, task: str, site: str, part: str, sent_to_site: int, received_from_site: int) -> None:
        self.rows.append({"round": rnd, "task": task, "site": site, "part": part,
                          "to_site": int(sent_to_site), "from_site": int(received_from_site)})

    def total(self, part: str | None = None) -> int:
        """All bytes both ways (of one part when given)."""
        return sum(r["to_site"] + r["from_site"] for r in self.rows if part is None or r["part"] == part)

    def per_site_round(self) -> dict[str, dict[int, dict[str, int]]]:
        """``{site: {round: {"to_site", "from_site"}}}`` summed over tasks."""
        out: dict[str, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: {"to_site": 0, "from_site": 0}))
        for r in self.rows:
            cell = out[r["site"]][r["round"]]
            cell["to_site"] += r["to_site"]
            cell["from_site"] += r["from_site"]
        return {s: dict(v) for s, v in out.items()}

    def write(self, path: str | Path, summary: dict[str, Any]) -> None:
        """The ledger and ``summary`` (measured vs predicted totals) as JSON."""
        data = {"summary": summary, "per_site_round": self.per_site_round(), "rows": self.rows}
        Path(path).write_text(json.dumps(data, indent=1))
