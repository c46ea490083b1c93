"""Differentiable augmentation for dataset condensation (DSA: Zhao & Bilen, ICML 2021), as FedVCK's reference uses it.

Why: a condensed set matched to un-augmented real features over-fits the encoder's exact view of the
data (positions, contrast); matching under random, *identical* transforms of the real and the synthetic
batch (Siamese augmentation) makes the synthetic images carry the class, not one view of it, and the
transforms are differentiable, so the gradient reaches the synthetic pixels through them.

What we chose (the reference's DSA family, magnitudes for images in [0, 1] instead of standardised ones):
one op per call, drawn uniformly from the strategy (the reference's single mode), with one set of
parameters for the whole call when ``draw(1, ...)`` is broadcast over a real and a synthetic batch (the
Siamese condensation step), or one per image (the server's training step):

- ``color``: brightness shift in +-``brightness``/2, saturation factor in [0, ``saturation``] (RGB only; a
  no-op on one channel), contrast factor in 1 +- ``contrast``/2 around each image's mean;
- ``crop``: translation by up to ``crop`` of the side (the reference's crop-and-pad);
- ``cutout``: a square of ``cutout`` x side filled with the image's mean;
- ``flip``: horizontal flip with probability 1/2 (not in our default strategy: left and right carry
  meaning in many medical images);
- ``scale``: independent x/y scale in [1/``scale``, ``scale``];
- ``rotate``: rotation in +-``rotate`` degrees.

Geometric ops resample with edge replication ("border"), so no black frame appears on [0, 1] images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from medflare.fedvck.config import OPS, check_strategy  # noqa: F401 - with the settings (torch-free), which check fedvck.augment


class DiffAugment:
    """Random differentiable image transforms for (B, C, H, W) tensors.

    Args:
        strategy: "_"-joined ops from :data:`OPS`; "" = identity. Required.
        brightness: width of the brightness shift range. Default 0.2 (+-0.1 on [0, 1] images).
        saturation: upper end of the saturation factor. Default 2.0 (DSA).
        contrast: width of the contrast factor range around 1. Default 0.5 (factor in [0.75, 1.25]).
        crop: largest translation as a fraction of the side. Default 0.125 (DSA).
        cutout: side of the cut-out square as a fraction of the image side. Default 0.5 (DSA).
        scale: largest scale factor (and 1/scale the smallest). Default 1.2 (DSA).
        rotate: largest rotation in degrees. Default 15 (DSA).

    Use ``params = aug.draw(n, generator)`` then ``aug.apply(x, params)``: ``n = 1`` gives one transform
    broadcast over every image of every batch it is applied to (Siamese), ``n = len(x)`` one per image.
    """

    def __init__(
        self,
        strategy: str,
        *,
        brightness: float = 0.2,
        saturation: float = 2.0,
        contrast: float = 0.5,
        crop: float = 0.125,
        cutout: float = 0.5,
        scale: float = 1.2,
        rotate: float = 15.0,
    ):
        self.ops = check_strategy(strategy)
        self.brightness, self.saturation, self.contrast = brightness, saturation, contrast
        self.crop, self.cutout, self.scale, self.rotate = crop, cutout, scale, rotate

    @property
    def enabled(self) -> bool:
        return bool(self.ops)

    def draw(self, n: int, generator: torch.Generator | None = None) -> dict:
        """One op and its random parameters for ``n`` images (``n = 1``: shared by all images it is applied to)."""
        if not self.ops:
            return {"op": None}
        g = generator
        op = self.ops[int(torch.randint(len(self.ops), (1,), generator=g))]

        def u(low: float, high: float) -> torch.Tensor:
            return low + (high - low) * torch.rand(n, generator=g)

        if op == "color":
            return {"op": op, "brightness": u(-self.brightness / 2, self.brightness / 2),
                    "saturation": u(0.0, self.saturation), "contrast": u(1 - self.contrast / 2, 1 + self.contrast / 2)}
        if op == "crop":
            return {"op": op, "tx": u(-self.crop, self.crop), "ty": u(-self.crop, self.crop)}
        if op == "cutout":
            half = self.cutout / 2
            low, high = min(half, 0.5), max(1 - half, 0.5)  # the square's centre keeps it inside the image
            return {"op": op, "cx": u(low, high), "cy": u(low, high)}
        if op == "flip":
            return {"op": op, "flip": torch.rand(n, generator=g) < 0.5}
        if op == "scale":
            return {"op": op, "sx": u(1 / self.scale, self.scale), "sy": u(1 / self.scale, self.scale)}
        return {"op": op, "angle": u(-self.rotate, self.rotate) * math.pi / 180}

    def apply(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        """``x`` (B, C, H, W) transformed by ``params`` (from :meth:`draw` with n = 1 or n = B); differentiable in x."""
        op = params["op"]
        if op is None:
            return x
        b = x.shape[0]

        def per_image(t: torch.Tensor) -> torch.Tensor:
            return t.to(x.device, x.dtype).expand(b) if t.numel() == 1 else t.to(x.device, x.dtype)

        if op == "color":
            x = x + per_image(params["brightness"]).view(b, 1, 1, 1)
            if x.shape[1] > 1:
                m = x.mean(dim=1, keepdim=True)
                x = (x - m) * per_image(params["saturation"]).view(b, 1, 1, 1) + m
            m = x.mean(dim=(1, 2, 3), keepdim=True)
            return (x - m) * per_image(params["contrast"]).view(b, 1, 1, 1) + m
        if op == "cutout":
            h, w = x.shape[-2:]
            ys = (torch.arange(h, device=x.device, dtype=x.dtype) + 0.5) / h
            xs = (torch.arange(w, device=x.device, dtype=x.dtype) + 0.5) / w
            cy, cx = per_image(params["cy"]).view(b, 1, 1), per_image(params["cx"]).view(b, 1, 1)
            inside = ((ys.view(1, h, 1) - cy).abs() < self.cutout / 2) & ((xs.view(1, 1, w) - cx).abs() < self.cutout / 2)
            keep = (~inside).to(x.dtype).unsqueeze(1)
            return x * keep + x.mean(dim=(1, 2, 3), keepdim=True) * (1 - keep)
        if op == "flip":
            flip = params["flip"].to(x.device).expand(b) if params["flip"].numel() == 1 else params["flip"].to(x.device)
            return torch.where(flip.view(b, 1, 1, 1), x.flip(-1), x)
        theta = torch.zeros(b, 2, 3, device=x.device, dtype=x.dtype)
        if op == "crop":  # normalised coordinates span 2 per side
            theta[:, 0, 0] = theta[:, 1, 1] = 1
            theta[:, 0, 2], theta[:, 1, 2] = 2 * per_image(params["tx"]), 2 * per_image(params["ty"])
        elif op == "scale":
            theta[:, 0, 0], theta[:, 1, 1] = per_image(params["sx"]), per_image(params["sy"])
        else:  # rotate
            a = per_image(params["angle"])
            theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = a.cos(), -a.sin(), a.sin(), a.cos()
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``x`` with a fresh transform per image."""
        return self.apply(x, self.draw(x.shape[0], generator))
