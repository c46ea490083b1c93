"""The result kind FedIOD saves (a ``medflare.result_kinds`` entry point), for ``medflare show | evaluate | predict | sample``.

Kind ``fediod_student`` (written by :mod:`.persistor`, the only writer): the student S (what ``evaluate`` / ``predict`` score: accuracy,
or Dice, sensitivity, specificity, HD95, and AJI / object Dice with ``--metrics`` on instance data) and the
generator G (what ``sample`` runs: ``--num`` unconditioned images for classification, one image per label
map of ``--labels`` for segmentation). ``show`` lists each site's (epsilon, delta), why a site stopped and the
segmentation student's decision offset (:mod:`.calibration`; already folded into the saved weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from medflare import ConfigError, ResultFileError
from medflare.common.payload import unflatten
from medflare.common.results import Predictor, Result, ResultKind, description_of, network_from
from medflare.nets import build_from_spec

KIND = "fediod_student"


class StudentResult(Result):
    """A saved FedIOD student + generator."""

    @property
    def student(self) -> torch.nn.Module:
        return self.networks["student"]

    @property
    def generator(self) -> torch.nn.Module:
        return self.networks["generator"]

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, Predictor]]:
        return [("student", self.student)]

    @torch.no_grad()
    def sample(self, label_maps: Sequence[torch.Tensor], options: Mapping[str, Any]) -> list[torch.Tensor]:
        rng = torch.Generator().manual_seed(int(options.get("seed", 0)))
        device = next(self.generator.parameters()).device
        if self.description.get("task") == "segmentation":
            if not label_maps:
                raise ConfigError(f"'{self.path}' holds a label-conditioned generator: pass --labels DATALIST (its label maps condition it)")
            styles = int(getattr(self.generator, "styles", 0) or 0)  # a styled G draws the i-th map in style i mod styles
            return [self.generator(self.generator.condition(y[None].cpu().long(), generator=rng,
                                                            style=torch.tensor([i % styles]) if styles else None).to(device))[0]
                    for i, y in enumerate(label_maps)]
        num = int(options.get("num", 8))
        return list(self.generator(self.generator.latent(num, generator=rng).to(device)))


def _load(data: Mapping[str, Any], path: Path) -> StudentResult:
    desc = description_of(data)
    state = data.get("model")
    if not isinstance(state, Mapping):
        raise ResultFileError(f"FedIOD result '{path}' has no 'model' state dict")
    parts = unflatten(state)
    missing = [k for k in ("student", "generator") if k not in parts]
    if missing or "generator" not in desc:
        raise ResultFileError(f"FedIOD result '{path}' lacks {missing or ['the generator spec']}")
    networks = {"student": network_from(desc["model"], parts["student"], f"file '{path}' (student)"),
                "generator": network_from(desc["generator"], parts["generator"], f"file '{path}' (generator)",
                                        build=lambda spec: build_from_spec(spec, role="generator"))}
    meta = data.get("meta_props") or {}
    info = {k.removeprefix("fediod_"): meta[k] for k in ("fediod_round", "fediod_sites", "fediod_privacy", "fediod_stopped",
                                                               "fediod_decision_offset") if k in meta}
    return StudentResult(path, desc, networks, info)


STUDENT = ResultKind(
    name=KIND,
    version=1,
    summary="FedIOD student (scored by evaluate/predict) + generator (sample), with each site's (epsilon, delta)",
    load=_load,
)
