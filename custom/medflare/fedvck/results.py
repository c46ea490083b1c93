"""The result kind FedVCK saves (a ``medflare.result_kinds`` entry point), for ``medflare show / evaluate / predict / sample``
(see :mod:`medflare.common.results`): the global model, projector and the condensed sets the server kept, in one dict.

Written after every round as ``FedVCK_result.pt`` by :class:`~medflare.fedvck.persistor.FedVCKPersistor` (the only
writer; beside its ``FL_global_model.pt`` / ``best_FL_global_model.pt``), a ``torch.save`` of tensors, numbers and
strings, so it loads with ``torch.load(weights_only=True)``. Layout::

    {"train_conf": {"medflare": describe(preset, overrides, kind="fedvck_result", fedvck={...settings})},
     "global": state_dict, "projector": state_dict, "projector_dims": [in, hidden],
     "condensed": {"<round>": {"<site>": {"images": uint8 (M, C, H, W), "labels": int64 (M,)}}},
     "sites": [names], "round": int (rounds completed), "metrics": {name: float}}

``medflare evaluate --model FedVCK_result.pt`` scores the global model, ``medflare show`` lists the parts and
the condensed images per round and class, ``medflare sample --model ... --out DIR`` writes the condensed
images of the last kept round (``--num`` of them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from medflare import ResultFileError
from medflare.common.results import Predictor, Result, ResultKind, description_of, network_from
from medflare.fedvck.contrastive import Projector

KIND = "fedvck_result"


class FedVCKResult(Result):
    """A loaded FedVCK result: the global model (what ``evaluate`` / ``predict`` run), the projector, the condensed sets."""

    def __init__(self, path, description, networks, condensed: dict, info: Mapping[str, Any]):
        super().__init__(path, description, networks, info)
        self.condensed = condensed

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, Predictor]]:
        return [("FedVCK global model", self.networks["global"])]

    def condensed_images(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (float in [0, 1]) and labels of every kept condensed set, rounds in order."""
        parts = [p for r in sorted(self.condensed, key=int) for p in self.condensed[r].values() if len(p["labels"])]
        if not parts:
            return torch.zeros(0), torch.zeros(0, dtype=torch.int64)
        return torch.cat([p["images"] for p in parts]).float() / 255.0, torch.cat([p["labels"] for p in parts])

    def parts(self) -> dict[str, str]:
        out = {"global model" if k == "global" else k: v for k, v in super().parts().items()}
        for r in sorted(self.condensed, key=int):
            labels = torch.cat([p["labels"] for p in self.condensed[r].values()]) if self.condensed[r] else torch.zeros(0, dtype=torch.int64)
            per_class = {int(c): int((labels == c).sum()) for c in torch.unique(labels).tolist()}
            shape = next((tuple(p["images"].shape[1:]) for p in self.condensed[r].values() if len(p["labels"])), ())
            out[f"condensed round {r}"] = f"{len(labels)} uint8 images {shape} from {len(self.condensed[r])} sites, per class {per_class}"
        return out

    def sample(self, label_maps: Sequence[torch.Tensor], options: Mapping[str, Any]) -> list[torch.Tensor]:
        """The condensed images of the last kept round (at most ``options["num"]``), each (C, H, W) in [0, 1]."""
        if label_maps:
            raise ResultFileError(f"'{self.path}': condensed sets are not conditioned on label maps; call sample without --labels")
        if not self.condensed:
            return []
        last = self.condensed[max(self.condensed, key=int)]
        images = torch.cat([p["images"] for p in last.values()]).float() / 255.0 if last else torch.zeros(0)
        return list(images[: int(options.get("num", 8))])


def load_fedvck_result(data: Mapping[str, Any], path: Path) -> FedVCKResult:
    """The registry's loader for kind ``fedvck_result``."""
    desc = description_of(data)
    missing = [k for k in ("global", "condensed", "sites") if k not in data]
    if missing:
        raise ResultFileError(f"FedVCK result file '{path}' lacks {missing}")
    networks = {"global": network_from(desc["model"], data["global"], f"file '{path}' (global model)")}
    dims = list(data.get("projector_dims") or [])
    if data.get("projector") and len(dims) == 2:
        networks["projector"] = network_from({"in": dims[0], "hidden": dims[1]}, data["projector"], f"file '{path}' (projector)",
                                             build=lambda spec: Projector(spec["in"], spec["hidden"]))
    info = {"round": data.get("round"), "sites": list(data["sites"]), "metrics": data.get("metrics", {}), "fedvck": desc.get("fedvck", {})}
    return FedVCKResult(path, desc, networks, dict(data["condensed"]), info)


FEDVCK_RESULT = ResultKind(
    name=KIND,
    version=1,
    summary="FedVCK: global model trained on the sites' condensed sets, its projector, and the condensed sets kept",
    load=load_fedvck_result,
)
