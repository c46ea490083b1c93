"""The result kinds FedST saves (``medflare.result_kinds`` entry points), for ``medflare show`` / ``evaluate`` / ``predict`` /
``sample`` (see :mod:`medflare.common.results`): the style store of FedST-separate and the generator of FedST-join,
each with the federated segmentation model.

Written by the server's :class:`~medflare.fedst.persistor.FedSTPersistor` (the only writer) as a plain dict of
tensors, strings and numbers (``torch.load(weights_only=True)`` reads it, no code runs). Layout::

    {"train_conf": {"medflare": describe(preset, overrides, kind=STYLE_STORE | JOIN_GENERATOR, diffusion={...})},
     "sites": [site names, domain-index order], "generator": StyleGenerator arguments,
     "generators": {site: state_dict}      # STYLE_STORE: one generator per site that uploaded one
     "generator_state": state_dict         # JOIN_GENERATOR: the one domain-conditioned generator
     "trained_classes": {site: [label classes its generator was trained on]}, "image_size": [H, W] | None,
     "versions": {site: round of its upload}, "segmentation": state_dict, "round": int, "metrics": {...}}

``medflare evaluate`` scores the segmentation model; ``medflare sample --domain SITE`` draws images in SITE's
style from a user's label maps (:meth:`FedSTResult.sample`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from medflare import ConfigError, DataError, ResultFileError
from medflare.common.results import Result, ResultKind, description_of, load_result, network_from
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import build_style_generator, sample_images, sampling_scheduler
from medflare.fedst.options import DOMAIN

STYLE_STORE = "fedst_style_store"
JOIN_GENERATOR = "fedst_join_generator"
KIND_OF = {"separate": STYLE_STORE, "join": JOIN_GENERATOR}


class FedSTResult(Result):
    """A loaded style store or join generator: the segmentation model, the generator(s) and the site map."""

    def __init__(self, path, description, networks, *, sites: Sequence[str], trained_classes: Mapping[str, Sequence[int]],
                 image_size: Sequence[int] | None, info: Mapping[str, Any]):
        super().__init__(path, description, networks, info)
        self.sites = list(sites)
        self.trained_classes = {s: list(v) for s, v in trained_classes.items()}
        self.image_size = list(image_size) if image_size else None
        self.diffusion = DiffusionConfig.from_dict(self.description.get("diffusion"))

    @property
    def segmentation(self) -> torch.nn.Module:
        return self.networks["segmentation"]

    @property
    def domains(self) -> list[str]:
        """Sites whose style this file can draw."""
        if self.kind == JOIN_GENERATOR:
            return list(self.sites)
        return [s for s in self.sites if f"generator[{s}]" in self.networks]

    def generator_for(self, domain: str):
        """``(generator, domain_index or None)`` drawing ``domain``'s style; ConfigError lists the known domains."""
        if domain not in self.domains:
            raise ConfigError(f"'{self.path}' has no generator for domain '{domain}' (its {'sites' if self.kind == JOIN_GENERATOR else 'style store'} "
                              f"holds {self.domains})")
        if self.kind == JOIN_GENERATOR:
            return self.networks["generator"], self.sites.index(domain)
        return self.networks[f"generator[{domain}]"], None

    def predictors(self, options: Mapping[str, Any]):
        return [("FedST segmentation model", self.segmentation)]

    def sample(self, label_maps: Sequence[torch.Tensor], options: Mapping[str, Any]) -> list[torch.Tensor]:
        """Images in the style of ``options["domain"]`` from label maps (1, H, W) of the file's image size (a join
        generator with the ``diffusion.domain_guidance`` its job's sites drew with)."""
        if not label_maps:
            raise ConfigError(f"'{self.path}': FedST generators draw images from label maps; pass --labels DATALIST")
        domain = options.get("domain")
        if not domain:
            raise ConfigError(f"'{self.path}': name the site whose style to draw with --domain (one of {self.domains})")
        generator, index = self.generator_for(domain)
        shapes = sorted({tuple(t.shape[-2:]) for t in label_maps})
        if self.image_size and shapes != [tuple(self.image_size)]:
            raise DataError(f"'{self.path}' was trained on {self.image_size[0]}x{self.image_size[1]} images; the label maps are {shapes}")
        device = next(generator.parameters()).device
        labels = torch.stack([t.to(device) for t in label_maps])
        images = sample_images(
            generator, sampling_scheduler(self.diffusion), labels, domain_index=index,
            trained_classes=self.trained_classes.get(domain), seed=int(options.get("seed", 0) or 0),
            batch_size=self.diffusion.sample_batch, device=device, who=f"the generator of '{domain}' in '{self.path}'",
            guidance=self.diffusion.domain_guidance,  # as the job's sites drew (a style store has no domains: ignored)
        )
        return list(images)

    def parts(self) -> dict[str, str]:
        out = super().parts()
        out["domains"] = ", ".join(f"{s} (classes {self.trained_classes.get(s, '?')})" for s in self.domains)
        return out


def result_from_checkpoint(data: Mapping[str, Any], path: Path) -> FedSTResult:
    """The registry's loader for both FedST kinds (``data`` read by :func:`read_checkpoint`)."""
    desc = description_of(data)
    kind = desc["kind"]
    need = ["sites", "generator", "segmentation", "generators" if kind == STYLE_STORE else "generator_state"]
    missing = [k for k in need if k not in data]
    if missing:
        raise ResultFileError(f"FedST file '{path}' lacks {missing}")
    nets = {"segmentation": network_from(desc["model"], data["segmentation"], f"file '{path}' (segmentation)")}
    args = dict(data["generator"])
    build = lambda spec: build_style_generator(spec["args"])  # noqa: E731 - network_from's builder signature
    if kind == STYLE_STORE:
        for site, state in data["generators"].items():
            nets[f"generator[{site}]"] = network_from({"args": args}, state, f"file '{path}' (generator of '{site}')", build=build)
    else:
        nets["generator"] = network_from({"args": args}, data["generator_state"], f"file '{path}' (join generator)", build=build)
    info = {"round": data.get("round"), "metrics": data.get("metrics", {}), "versions": data.get("versions", {}),
            "image_size": data.get("image_size"), "generator": args}
    return FedSTResult(path, desc, nets, sites=data["sites"], trained_classes=data.get("trained_classes", {}),
                       image_size=data.get("image_size"), info=info)


def load_fedst_result(path: str | os.PathLike) -> FedSTResult:
    """A FedST style store or join generator file; ResultFileError if the file holds another kind."""
    result = load_result(path)
    if not isinstance(result, FedSTResult):
        raise ResultFileError(f"result file '{path}' holds kind '{result.kind}', not a FedST style store or join generator")
    return result


def check_compatible(path: str | os.PathLike, variant: str, preset: str, generator_args: Mapping[str, Any], num_classes: int) -> FedSTResult:
    """A saved FedST file that a job may start from: same variant, generator architecture and classes, else
    ResultFileError naming the file and what differs (a generator file from another preset)."""
    result = load_fedst_result(path)
    if result.kind != KIND_OF[variant]:
        raise ResultFileError(f"'{path}' is a {result.kind}; FedST-{variant} starts from a {KIND_OF[variant]}")
    saved = {k: v for k, v in result.info["generator"].items() if k != "num_domains"}
    wanted = {k: v for k, v in generator_args.items() if k != "num_domains"}
    diff = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if diff or int(result.description["data"]["num_classes"]) != int(num_classes):
        detail = ", ".join(f"{k}: file {saved.get(k)!r} vs job {wanted.get(k)!r}" for k in diff) or "num_classes differs"
        raise ResultFileError(f"generator file '{path}' (preset '{result.description['preset']}') does not fit this job's "
                              f"preset '{preset}': {detail}")
    return result


STYLE_STORE_KIND = ResultKind(
    name=STYLE_STORE, version=1, load=result_from_checkpoint, options=(DOMAIN,),
    summary="FedST-separate style store: one label-conditioned diffusion generator per site + the FedAvg segmentation model",
)
JOIN_GENERATOR_KIND = ResultKind(
    name=JOIN_GENERATOR, version=1, load=result_from_checkpoint, options=(DOMAIN,),
    summary="FedST-join generator: one federated diffusion generator with a domain vector + the FedAvg segmentation model",
)
