"""Blockwise absmax quantization of weight diffs for the wire, with error feedback.

Plain numpy, no FLARE. Used where a model's change travels many times a round (FedST-join's generator,
``diffusion.exchange_dtype`` "int8" / "int4"): every float entry is cut into blocks of :data:`BLOCK` values, each
sent as signed ``bits``-bit integers (two per byte at 4 bits) times one float16 scale, the block's largest magnitude
over ``2**(bits-1) - 1`` (QSGD-style blockwise rounding, as bitsandbytes' blockwise modes that FLARE's
``ModelQuantizer`` uses, which need bitsandbytes and CUDA; this one runs anywhere).

An encoded state keeps every entry's name for its integers and adds ``<name>::scale`` (float16, one per block) and
``<name>::shape`` (int32): a receiver decodes it without knowing the model, to float16 (integers times a float16
scale: the type of a whole model sent in float16, so a quantized diff and a float16 one have the same structure).
Integer entries travel as they are.

Rounding a small change to a coarse grid loses it every time; :class:`ErrorFeedback` adds what the last send lost
to the next one, so the sum received stays within one rounding of the sum sent (error feedback, Seide et al. 2014;
Karimireddy et al. 2019). A down-link needs no residual: the sender sends the target minus what the receiver holds,
which already contains the last rounding.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from medflare import PayloadError

BLOCK = 64
BITS = (4, 8)
SCALE, SHAPE = "::scale", "::shape"
DECODED = np.dtype(np.float16)


def _levels(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"quantization bits must be one of {BITS}, got {bits!r}")
    return 2 ** (bits - 1) - 1


def _is_float(value: Any) -> bool:
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def _blocks(size: int) -> int:
    """Blocks (float16 scales) of an entry of ``size`` values."""
    return -(-size // BLOCK)


def _code_bytes(size: int, bits: int) -> int:
    """Bytes of an entry's packed codes (the last block's padding stays home)."""
    return (size * bits + 7) // 8


def _shape(payload: Mapping[str, Any], name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in np.asarray(payload[name + SHAPE]).reshape(-1))


def encode(state: Mapping[str, Any], bits: int) -> dict[str, np.ndarray]:
    """``state``'s float entries as blockwise ``bits``-bit integers + float16 scales (+ shapes); others as they are."""
    levels = _levels(bits)
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if not _is_float(value):
            out[name] = value
            continue
        a = np.asarray(value, dtype=np.float32)
        flat = a.reshape(-1)
        blocks = np.concatenate([flat, np.zeros((-flat.size) % BLOCK, np.float32)]).reshape(-1, BLOCK)
        with np.errstate(over="ignore"):  # refused below, by name
            scale = (np.abs(blocks).max(axis=1, keepdims=True) / levels).astype(np.float16)  # the scale as it arrives
        if not np.isfinite(scale).all():
            raise PayloadError(f"entry '{name}' has values beyond float16's range or not finite; it cannot be quantized")
        wide = scale.astype(np.float32)
        codes = (np.round(blocks / np.where(wide > 0, wide, 1.0)).clip(-levels, levels) + levels).astype(np.uint8)
        codes = codes.reshape(-1)[: flat.size + (flat.size % 2 if bits == 4 else 0)]  # the padding stays home (a 4-bit pair aside)
        if bits == 4:
            codes = (codes[0::2] << 4) | codes[1::2]
        out[name] = codes
        out[name + SCALE] = scale.reshape(-1)
        out[name + SHAPE] = np.asarray(a.shape, dtype=np.int32)
    return out


def is_encoded(payload: Mapping[str, Any]) -> bool:
    """Whether ``payload`` is an :func:`encode` output (it holds at least one ``::scale`` entry)."""
    return any(k.endswith(SCALE) for k in payload)


def decode(payload: Mapping[str, Any], bits: int) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode` (float16 entries); PayloadError naming the entry on a malformed payload."""
    levels = _levels(bits)
    out: dict[str, np.ndarray] = {}
    for name, value in payload.items():
        if name.endswith((SCALE, SHAPE)):
            continue
        if name + SCALE not in payload:
            out[name] = value
            continue
        try:
            shape = _shape(payload, name)
            scale = np.asarray(payload[name + SCALE], dtype=np.float32).reshape(-1, 1)
            codes = np.asarray(value, dtype=np.uint8).reshape(-1)
            size = int(np.prod(shape))
            if codes.size != _code_bytes(size, bits) or scale.shape[0] != _blocks(size):
                raise ValueError(f"{codes.size} code bytes and {scale.shape[0]} scales for {size} values")
            if bits == 4:
                codes = np.stack([codes >> 4, codes & 0xF], axis=1).reshape(-1)
            codes = np.concatenate([codes, np.full(scale.shape[0] * BLOCK - codes.size, levels, np.uint8)])
            blocks = (codes.astype(np.float32) - levels).reshape(scale.shape[0], BLOCK) * scale
            out[name] = blocks.reshape(-1)[:size].reshape(shape).astype(DECODED)
        except (KeyError, ValueError) as e:
            raise PayloadError(f"quantized entry '{name}' is malformed ({bits}-bit codes, scales and shape disagree): {e}") from e
    return out


def decoded_structure(payload: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of what :func:`decode` makes of ``payload``, without decoding it."""
    out = {}
    for name, value in payload.items():
        if name.endswith((SCALE, SHAPE)):
            continue
        if name + SHAPE in payload:
            out[name] = (_shape(payload, name), DECODED)
        else:
            out[name] = (tuple(np.shape(value)), np.asarray(value).dtype)
    return out


def encoded_bytes(state: Mapping[str, Any], bits: int) -> int:
    """Bytes of ``encode(state, bits)`` without encoding: packed integers, float16 scales, int32 shapes."""
    total = 0
    for value in state.values():
        a = np.asarray(value)
        if not _is_float(a):
            total += a.nbytes
            continue
        total += _code_bytes(a.size, bits) + 2 * _blocks(a.size) + 4 * a.ndim
    return total


class ErrorFeedback:
    """A sender's residual: :meth:`send` encodes ``change`` plus what the last send's rounding lost of each entry."""

    def __init__(self, bits: int):
        _levels(bits)
        self.bits = bits
        self.residual: dict[str, np.ndarray] = {}

    def send(self, change: Mapping[str, Any]) -> dict[str, np.ndarray]:
        want = {k: np.asarray(v, np.float32) + self.residual[k] if _is_float(v) and k in self.residual else v
                for k, v in change.items()}
        sent = encode(want, self.bits)
        got = decode(sent, self.bits)
        self.residual.update({k: want[k] - got[k] for k in want if _is_float(want[k])})  # entries not sent keep theirs
        return sent
