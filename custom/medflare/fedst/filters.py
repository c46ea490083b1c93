"""FedST-join's wire codec for the generator's diffs: :mod:`medflare.common.diff_quantizer`'s filters with their
bits read from the job's ``diffusion.exchange_dtype`` ("int8" / "int4"; a float type passes everything through).

The FedST-join recipe always registers them on ``train_generator`` (the site's after its privacy scope, the server's
before the update guard), so a job whose preset or overrides turn quantization on (``medflare run fedst_join --set
diffusion.exchange_dtype=int4``, a job folder's ``overrides``) has its codec without editing the filter chains.
"""

from __future__ import annotations

from typing import Any, Mapping

from medflare.common.component import keep_args
from medflare.common.diff_quantizer import DiffDequantizer, DiffQuantizer
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import quantized_bits
from medflare.presets import get_preset


def exchange_bits(preset: str, overrides: Mapping[str, Any] | None) -> int:
    """The bits the join generator's diffs travel in under ``preset`` + ``overrides``; 0 for a float type."""
    return quantized_bits(DiffusionConfig.from_preset(get_preset(preset, overrides)).exchange_dtype) or 0


class GeneratorDiffQuantizer(DiffQuantizer):
    """Site result filter on ``train_generator``. Args: preset, overrides: the job's."""

    def __init__(self, preset: str = "fedst", overrides: Mapping[str, Any] | None = None):
        super().__init__(exchange_bits(preset, overrides))
        keep_args(self, preset=preset, overrides=overrides)


class GeneratorDiffDequantizer(DiffDequantizer):
    """Server result filter on ``train_generator``. Args: preset, overrides: the job's."""

    def __init__(self, preset: str = "fedst", overrides: Mapping[str, Any] | None = None):
        super().__init__(exchange_bits(preset, overrides))
        keep_args(self, preset=preset, overrides=overrides)
