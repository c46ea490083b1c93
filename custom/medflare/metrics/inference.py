"""Predicting a whole volume with a model trained on slices or patches (evaluation and ``medflare predict``).

A 2D model runs slice by slice along the slicing axis and its outputs are stacked back into the volume;
a 3D model runs as MONAI ``sliding_window_inference`` over patch-sized windows (Gaussian-weighted where
windows overlap), so volumes of any size are predicted with the patch the model was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from medflare import MedflareError

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class VolumeInference:
    """How a model predicts a volume ``(B, C, H, W, D)``; :meth:`wrap` turns its forward into such a predictor.

    Args:
        model_dims: 2 (slice by slice along ``axis``) or 3 (sliding window).
        axis: spatial axis the 2D model's slices were drawn along (0, 1 or 2). Default 2.
        roi_size: 3D window size in voxels (the training patch). Required for ``model_dims`` 3.
        overlap: fraction of overlap between neighbouring windows. Default 0.25.
        sw_batch_size: windows per forward pass. Default 4.
        slice_batch: slices per forward pass of a 2D model. Default 16.
    """

    model_dims: int
    axis: int = 2
    roi_size: Sequence[int] | None = None
    overlap: float = 0.25
    sw_batch_size: int = 4
    slice_batch: int = 16

    def wrap(self, forward: Forward) -> Forward:
        """``images (B, C, H, W, D) -> (B, K, H, W, D)``: logits (K = classes) or a label map (K = 1)."""
        if self.model_dims == 2:
            return lambda images: self._slices(forward, images)
        if self.model_dims == 3:
            if self.roi_size is None:
                raise MedflareError("VolumeInference: 'roi_size' is required for 3D models")
            return lambda images: self._windows(forward, images)
        raise MedflareError(f"VolumeInference: 'model_dims' must be 2 or 3, got {self.model_dims!r}")

    def _slices(self, forward: Forward, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 5:
            raise MedflareError(f"a volume batch must be (B, C, H, W, D), got shape {tuple(images.shape)}")
        dim = self.axis + 2
        outputs = []
        for volume in images:  # (C, H, W, D)
            slices = volume.movedim(dim - 1, 0)  # (S, C, a, b)
            parts = [forward(slices[s: s + self.slice_batch]) for s in range(0, slices.shape[0], self.slice_batch)]
            outputs.append(torch.cat(parts).movedim(0, dim - 1))  # (K, H, W, D)
        return torch.stack(outputs)

    def _windows(self, forward: Forward, images: torch.Tensor) -> torch.Tensor:
        from monai.inferers import sliding_window_inference

        return sliding_window_inference(images, list(self.roi_size), self.sw_batch_size, forward,
                                        overlap=self.overlap, mode="gaussian")
