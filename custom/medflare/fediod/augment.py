"""Intensity perturbations of the generated images the student replays (not in the paper; ``fediod.student_augment``).

Why: the student learns from G's images only. On these sites G draws the disc and cup where the label map says, in each
site's contrast, but without the real images' vessels and textured background and with a stride-2 checkerboard
(jobs/fediod_seg/README.md), and the student under-segments real images (validation sensitivity 0.62-0.72 at
specificity 0.99; the decision offset corrects its threshold after training). Perturbing the intensities of what it
trains on (blur, contrast gamma, a smooth bias field, noise: MONAI's intensity transforms) keeps it from keying on
G's intensity idiosyncrasies, the domain randomisation of sim-to-real training. No pixel moves, so the targets of a
replayed batch (the ensemble logits and the conditioning label map) stay right unchanged.

Only the replay steps see perturbed images (``student_steps`` - 1 per generated batch): Algorithm 1's own step, whose
output also enters G's loss through L_mimic, is on G's image as drawn. Server-side post-processing of G's own outputs:
no message, nothing the sites sent is touched. Plain torch + MONAI, no FLARE.

Measured (jobs/fediod_seg/README.md, "Intensity perturbations"): through FLARE at ``fediod_seg`` with probability 0.5,
client-average Dice +2.34 / +0.39 / -0.98 / -3.24 at seeds 0-3 against the same job without (paired mean -0.37; one
site, site-4, lower at three seeds), so every preset keeps 0. The transforms run per image on the CPU (about 10 ms for a
64x64 blur), and the bias field can take an image above 1.
"""

from __future__ import annotations

import torch
from monai.transforms import Compose, RandAdjustContrast, RandBiasField, RandGaussianNoise, RandGaussianSmooth
from monai.utils import convert_to_tensor


class IntensityAugment:
    """Each transform on each image of a batch with probability ``prob``; images (B, C, *spatial), 2D or 3D, in [0, 1]
    (G's sigmoid output). ``seed`` fixes the draws (MONAI's per-transform random states), separate from G's noise."""

    def __init__(self, prob: float, seed: int = 0):
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"student_augment is a probability in [0, 1], got {prob}")
        # 0.25-1 pixel blur (G's checkerboard is one pixel), gamma 0.6-1.6, a smooth multiplicative bias field (degree 3,
        # coefficients up to 0.3), Gaussian noise of std 0.03 on G's [0, 1] range; measured at these settings only
        self.prob = float(prob)
        self.transforms = Compose([
            RandGaussianSmooth(sigma_x=(0.25, 1.0), sigma_y=(0.25, 1.0), sigma_z=(0.25, 1.0), prob=prob),
            RandAdjustContrast(gamma=(0.6, 1.6), prob=prob),
            RandBiasField(coeff_range=(0.0, 0.3), prob=prob),
            RandGaussianNoise(std=0.03, prob=prob),
        ])
        self.transforms.set_random_state(int(seed))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prob:
            return x
        out = [convert_to_tensor(self.transforms(image.detach().cpu()), dtype=torch.float32, track_meta=False) for image in x]
        return torch.stack(out).to(x.device)
