"""A site's own FedST folder: the generators it received and the synthetic images it drew. Nothing here is sent.

Plain torch, no FLARE. FedST's three site executors (generator training, sampling, segmentation) hand each
other their results through this folder (inside the site's run directory), the way the reference code's
offline generation scripts wrote synthetic images to disk for the segmentation training to read:

- ``generators/<key>.pt``: a generator's weights with the round (``version``) it is from and the classes it was
  trained on; key = the domain's site name (FedST-separate's style store) or ``join`` (the global generator);
- ``synthetic/<domain>.pt``: images drawn in ``domain``'s style from this site's training label maps, with the
  generator version they came from (the cache is refreshed when a newer generator arrives on a refresh round);
- ``current.json``: the domain the segmentation training of this round uses.

Files are ``torch.save`` of plain dicts and load with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from medflare import DataError
from medflare.common.results import save_checkpoint

JOIN_KEY = "join"


def _safe(name: str) -> str:
    """A file name for a site name (site names may hold characters a file system dislikes)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


class SiteStyleCache:
    """The folder ``root`` of one site (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # ---- generators ----
    def put_generator(self, key: str, params: Mapping[str, Any], version: int, classes: Sequence[int] = ()) -> None:
        state = {k: torch.as_tensor(np.array(v, copy=True)) for k, v in params.items()}
        save_checkpoint({"state": state, "version": int(version), "classes": [int(c) for c in classes]}, self.root / "generators" / f"{_safe(key)}.pt")

    def generator(self, key: str) -> dict[str, Any] | None:
        """``{"state", "version", "classes"}`` of generator ``key``, or None if this site never received it."""
        path = self.root / "generators" / f"{_safe(key)}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None

    def generator_version(self, key: str) -> int | None:
        entry = self.generator(key)
        return None if entry is None else int(entry["version"])

    # ---- synthetic images ----
    def put_synthetic(self, domain: str, images: torch.Tensor, labels: torch.Tensor, version: int, round_num: int) -> None:
        save_checkpoint({"images": images.cpu(), "labels": labels.cpu(), "version": int(version), "round": int(round_num), "domain": domain},
              self.root / "synthetic" / f"{_safe(domain)}.pt")

    def synthetic(self, domain: str) -> dict[str, Any] | None:
        """``{"images" (N,C,H,W), "labels" (N,1,H,W), "version", "round", "domain"}`` or None."""
        path = self.root / "synthetic" / f"{_safe(domain)}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None

    # ---- this round's choice ----
    def set_current(self, domain: str, round_num: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "current.json").write_text(json.dumps({"domain": domain, "round": int(round_num)}))

    def current(self, site: str) -> dict[str, Any]:
        """This round's synthetic set ``{"domain", "round", "images", "labels", ...}``; DataError when none was drawn."""
        path = self.root / "current.json"
        if not path.is_file():
            raise DataError(f"site '{site}': no synthetic images were drawn before segmentation training (no '{path}'); "
                            "the sample task must run first")
        choice = json.loads(path.read_text())
        entry = self.synthetic(choice["domain"])
        if entry is None:
            raise DataError(f"site '{site}': the synthetic images of domain '{choice['domain']}' are missing from '{self.root}'")
        return {**entry, "round": choice["round"]}
