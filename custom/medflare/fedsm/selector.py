"""FedSM's model selector: the federated global model's encoder as feature extractor, one Gaussian per site on top.

Why not the paper's VGG-11 trained by FedAvg on Eq. 2 labels? Each site only ever sees its own label, so
local training collapses to "always my site" and averaging such updates stays at chance within our
budget (measured: jobs/fedsm/README.md, "Selector"); and a softmax classifier is confident far from its
training data, so an unseen scanner goes with full confidence to whichever site it resembles.

:class:`EncoderGaussianSelector` instead takes features *learned from the data*: the first ``levels``
down-sampling blocks of the global UNet, which FedAvg has already trained on every site (no extra
training round trip), summarised per channel by the spatial mean and log standard deviation of their
outputs (2 x channels per level; the residual path of MONAI's units carries the intensity statistics
that instance norm removes from the main path). On these it holds one Gaussian per site
(:mod:`.density`): its output for site k is the calibrated *typicality* of a case for site k, so Algorithm
2's ``max > gamma`` sends a case that is atypical of every site to the global model.

The stem is a copy of the global model's blocks *as the sites used them* to compute the Gaussians (the
global model of the round before), so a saved super model is consistent: features, Gaussians and
calibration come from the same weights.

FedSM-extra adds a linear head on the standardised features with K + 1 outputs (0 = global model), trained
in the extra rounds with Eq. 1 labels (:mod:`.extra`); when trained it picks among the models a case
passing the typicality gate may use.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from medflare import ConfigError
from medflare.fedsm import density
from medflare.fedsm.config import FedSMConfig
from medflare.nets import build_from_spec, register


def unet_down_blocks(net: nn.Module, levels: int) -> list[nn.Module]:
    """The first ``levels`` down-sampling blocks of a MONAI ``UNet``, in the order the encoder applies them.

    MONAI nests its UNet as ``Sequential(down, SkipConnection(Sequential(down, SkipConnection(...), up)), up)``
    with the bottom block innermost; the encoder path is the chain of ``down`` blocks.
    """
    from monai.networks.layers.simplelayers import SkipConnection
    from monai.networks.nets import UNet

    if not isinstance(net, UNet):
        raise ConfigError(f"the FedSM selector reads the encoder of MONAI's UNet; the preset's network is {type(net).__name__}")
    blocks: list[nn.Module] = []
    node: nn.Module | None = net.model
    while node is not None and len(blocks) < levels:
        if isinstance(node, nn.Sequential) and len(node) == 3 and isinstance(node[1], SkipConnection):
            blocks.append(node[0])
            node = node[1].submodule
        else:  # the bottom block
            blocks.append(node)
            node = None
    if len(blocks) < levels:
        raise ConfigError(f"selector 'levels' = {levels} exceeds the UNet's {len(blocks)} levels")
    return blocks


def encoder_features(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) -> (B, d) float64: per channel of each block's output, spatial mean and log standard deviation.

    ``blocks`` are encoder blocks applied in order (:func:`unet_down_blocks` of a global model, or a selector's stem).
    """
    out, h = [], x
    for block in blocks:
        h = block(h)
        dims = tuple(range(2, h.ndim))
        out += [h.mean(dims), torch.log(h.std(dims) + 1e-4)]
    return torch.cat(out, 1).double()


class EncoderGaussianSelector(nn.Module):
    """Site typicality from per-site Gaussians of global-encoder features (see the module docstring).

    Args:
        model: ``{"name", "args"}`` of the segmentation network (the preset's); a MONAI UNet. Required.
        num_sites: K, the number of personalised models. Required.
        levels: encoder levels whose outputs give features (2 x their channels each). Default 2.
        shrinkage: weight of the diagonal in each site's covariance (:func:`medflare.fedsm.density.shrunk_precision`). Default 0.2.
        global_class: FedSM-extra: add the K + 1 head (column 0 = global model). Default False.

    Buffers (saved and sent with the weights): per site ``mean`` (K, d), ``precision`` (K, d, d), ``scale``
    and ``dof`` (K,) of the calibration, ``present`` (K,) 1 where the site's Gaussian is set; with
    ``global_class`` the head's input standardisation ``head_mean``/``head_std`` (d,) and ``head_trained``.
    """

    def __init__(self, model: Mapping[str, Any], num_sites: int, levels: int = 2, shrinkage: float = 0.2, global_class: bool = False):
        super().__init__()
        for key, value in (("num_sites", num_sites), ("levels", levels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"encoder_gaussian selector: '{key}' must be a positive int, got {value!r}")
        if not isinstance(shrinkage, (int, float)) or not 0 <= shrinkage <= 1:
            raise ConfigError(f"encoder_gaussian selector: 'shrinkage' must lie in [0, 1], got {shrinkage!r}")
        self.model_spec = {"name": model["name"], "args": dict(model.get("args", {}))}
        net = build_from_spec(self.model_spec)
        self.stem = nn.Sequential(*unet_down_blocks(net, levels))
        self.levels, self.shrinkage, self.global_class = levels, float(shrinkage), bool(global_class)
        self.dim = 2 * sum(int(c) for c in net.channels[:levels])
        K, d = num_sites, self.dim
        self.register_buffer("mean", torch.zeros(K, d))
        self.register_buffer("precision", torch.zeros(K, d, d))
        self.register_buffer("scale", torch.ones(K))
        self.register_buffer("dof", torch.ones(K))
        self.register_buffer("present", torch.zeros(K))
        if self.global_class:
            self.head = nn.Linear(d, K + 1)
            nn.init.zeros_(self.head.weight), nn.init.zeros_(self.head.bias)
            self.register_buffer("head_mean", torch.zeros(d))
            self.register_buffer("head_std", torch.ones(d))
            self.register_buffer("head_trained", torch.zeros(()))
        self.requires_grad_(False)  # trained by the server from statistics and gradients, never by autograd at a site

    @property
    def num_sites(self) -> int:
        return self.mean.shape[0]

    # ---- features ------------------------------------------------------------------------------
    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, *spatial) -> (B, d) float64 features of the stem (:func:`encoder_features`)."""
        return encoder_features(self.stem, x)

    def set_stem(self, global_model: nn.Module) -> None:
        """Copy the global model's first ``levels`` encoder blocks into the stem (the weights the sites' features use)."""
        for own, theirs in zip(self.stem, unet_down_blocks(global_model, self.levels)):
            own.load_state_dict(theirs.state_dict())

    def set_stem_params(self, params: Mapping[str, np.ndarray]) -> None:
        """:meth:`set_stem` from a flat state of the global model (as on the wire)."""
        from medflare.common.payload import load_numpy_state

        net = build_from_spec(self.model_spec)
        load_numpy_state(net, params, who="the global model (selector stem)")
        self.set_stem(net)

    # ---- the per-site Gaussians ------------------------------------------------------------------
    def set_site(self, index: int, stats: density.Stats) -> None:
        """Site ``index``'s Gaussian and calibration from the statistics it sent (:func:`medflare.fedsm.density.site_gaussian`)."""
        density.check_stats(stats, self.dim, f"site {index}")
        cov = torch.as_tensor(np.asarray(stats["cov"]), dtype=torch.float64)
        scale, dof = density.calibration(int(stats["val_n"]) or int(stats["n"]), float(stats["val_d2_mean"]), float(stats["val_d2_var"]), self.dim)
        with torch.no_grad():
            self.mean[index] = torch.as_tensor(np.asarray(stats["mean"]))
            self.precision[index] = density.shrunk_precision(cov, self.shrinkage).float()
            self.scale[index], self.dof[index], self.present[index] = scale, dof, 1.0

    def clear_sites(self) -> None:
        """Forget every Gaussian (before the statistics of a new encoder arrive): no site is selectable."""
        self.present.zero_()

    def typicality(self, features: torch.Tensor) -> torch.Tensor:
        """(B, d) features -> (B, K) typicality of each case for each site; 0 for a site without a Gaussian."""
        out = features.new_zeros((features.shape[0], self.num_sites), dtype=torch.float64)
        for k in torch.nonzero(self.present).flatten().tolist():
            d2 = density.mahalanobis_sq(features, self.mean[k].double(), self.precision[k].double())
            out[:, k] = density.typicality(d2, self.scale[k].double(), self.dof[k].double())
        return out

    # ---- the FedSM-extra head --------------------------------------------------------------------
    @property
    def head_ready(self) -> bool:
        return self.global_class and bool(self.head_trained)

    def head_input(self, features: torch.Tensor) -> torch.Tensor:
        """Standardised features the head reads: (B, d) -> (B, d) float32."""
        return ((features - self.head_mean.double()) / self.head_std.double()).float()

    def set_head_standardisation(self, stats: Sequence[density.Stats]) -> None:
        mean, std = density.pooled_moments(stats)
        with torch.no_grad():
            self.head_mean.copy_(mean), self.head_std.copy_(std)

    # ---- inference ---------------------------------------------------------------------------------
    def route_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(typicality (B, K), head probabilities (B, K + 1) once the FedSM-extra head is trained, else None)."""
        f = self.features(x)
        head = torch.softmax(self.head(self.head_input(f)), dim=1) if self.head_ready else None
        return self.typicality(f), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, *spatial) images -> (B, K) typicality for each site."""
        return self.typicality(self.features(x))


register("selector", "encoder_gaussian", EncoderGaussianSelector)  # built by name like every network


def build_selector(spec: Mapping[str, Any]) -> EncoderGaussianSelector:
    """``{"name", "args"}`` -> selector (:func:`medflare.nets.build_from_spec`, role "selector"); ConfigError names an
    unknown selector."""
    return build_from_spec(spec, role="selector")


def check_selector_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The job's ``fedsm.selector`` setting as a dict; ConfigError names an unknown key or a bad value."""
    return FedSMConfig.from_dict({"selector": args}).selector


def selector_spec(model: Mapping[str, Any], sites: Sequence[str], global_class: bool, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The selector's ``{"name", "args"}`` for a run: the preset's network, the sites, FedSM-extra or not, user args."""
    args = check_selector_args(args or {})
    return {"name": "encoder_gaussian",
            "args": {"model": dict(model), "num_sites": len(sites), "global_class": bool(global_class), **args}}
