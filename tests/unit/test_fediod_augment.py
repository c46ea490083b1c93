"""fediod.student_augment (not in the paper): MONAI's intensity transforms on the images the student replays, seeded and
shape-preserving (that only the replay steps see them: tests/unit/test_fediod_protocol.py)."""

import pytest
import torch

from medflare.fediod.augment import IntensityAugment


def test_the_perturbation_keeps_shape_and_dtype_is_seeded_and_off_at_zero():
    x = torch.rand(6, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    y = IntensityAugment(0.5, seed=3)(x)
    assert y.shape == x.shape and y.dtype == torch.float32 and type(y) is torch.Tensor  # not a MONAI MetaTensor
    assert torch.equal(y, IntensityAugment(0.5, seed=3)(x))  # the same seed, the same draws
    assert not torch.equal(y, IntensityAugment(0.5, seed=4)(x))
    changed = (y - x).abs().flatten(1).amax(1) > 1e-6
    # four transforms, each with probability 0.5 per image: an image is left as it was with probability 1/16
    assert int(changed.sum()) >= len(x) - 1, changed
    assert IntensityAugment(0.0)(x) is x
    assert IntensityAugment(1.0)(torch.rand(2, 1, 8, 8, 8)).shape == (2, 1, 8, 8, 8)  # volumes too
    with pytest.raises(ValueError, match="probability"):
        IntensityAugment(1.5)
