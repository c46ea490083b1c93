"""The wire's quantization of weight diffs as a pair of FLARE filters (the shape of FLARE's ModelQuantizer /
ModelDequantizer, whose 8- and 4-bit modes need bitsandbytes and CUDA; the codec is :mod:`medflare.common.quantize`).

- :class:`DiffQuantizer`, a site's task result filter on the job's side: runs after the site's privacy scope (FLARE
  runs a scope's filters first), so the scope's filters see the float diff and this one only compresses what they
  passed. It keeps the site's residual (error feedback) from one send to the next.
- :class:`DiffDequantizer`, a server task result filter: turns the integers back into float16 diffs before the update
  guard and the workflow read them, and notes in the DXO's meta (:data:`WIRE_BYTES`) how many bytes arrived, for the
  workflow's byte ledger.

Both act on WEIGHT_DIFF parts only (FLARE's DXOFilter recurses into a COLLECTION reply) and pass everything through
with ``bits`` 0. An algorithm registers them for the tasks whose diffs may travel quantized, reading ``bits`` from its
job's settings (FedST-join's ``train_generator``: :mod:`medflare.fedst.filters`).
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare.common.payload import payload_bytes
from medflare.common.quantize import ErrorFeedback, decode, is_encoded

#: DXO meta key (server side only) with the bytes a quantized diff had on the wire
WIRE_BYTES = "medflare_wire_bytes"


class DiffQuantizer(DXOFilter):
    """Site result filter: every WEIGHT_DIFF part as ``bits``-bit blockwise integers, with error feedback.

    Args: bits: 8 or 4; 0 = send as it is.
    """

    def __init__(self, bits: int = 0):
        super().__init__(supported_data_kinds=[DataKind.WEIGHT_DIFF], data_kinds_to_filter=[DataKind.WEIGHT_DIFF])
        self.bits = bits
        self.feedback = ErrorFeedback(bits) if bits else None

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        if self.feedback is None or is_encoded(dxo.data):
            return None  # not filtered: FLARE leaves it out of the DXO's filter history
        size = payload_bytes(dxo.data)
        dxo.data = self.feedback.send(dxo.data)
        self.log_debug(fl_ctx, f"weight diff quantized to {self.feedback.bits} bits: {size} -> {payload_bytes(dxo.data)} B")
        return dxo


class DiffDequantizer(DXOFilter):
    """Server result filter: a quantized WEIGHT_DIFF part back to float16, its wire bytes in meta :data:`WIRE_BYTES`.

    Args: bits: as the sites' :class:`DiffQuantizer` (0: nothing to decode).
    """

    def __init__(self, bits: int = 0):
        super().__init__(supported_data_kinds=[DataKind.WEIGHT_DIFF], data_kinds_to_filter=[DataKind.WEIGHT_DIFF])
        self.bits = bits

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        if not (self.bits and is_encoded(dxo.data)):
            return None  # not filtered: FLARE leaves it out of the DXO's filter history (the sites' filters stay the log's)
        dxo.set_meta_prop(WIRE_BYTES, payload_bytes(dxo.data))
        dxo.data = decode(dxo.data, self.bits)
        return dxo
