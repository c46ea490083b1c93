"""The result kinds FedST saves (``medflare.result_kinds`` entry points), for ``medflare show`` / ``evaluate`` / ``predict`` /
``sample``
(see :mod:`medflare.common.results`): the style store of FedST-separate and the generator of FedST-join,
each with the federated segmentation model."""

from medflare.common.results import ResultKind
from medflare.fedst.options import DOMAIN
from medflare.fedst.store import JOIN_GENERATOR, STYLE_STORE, result_from_checkpoint

STYLE_STORE_KIND = ResultKind(
    name=STYLE_STORE, version=1, load=result_from_checkpoint, options=(DOMAIN,),
    summary="FedST-separate style store: one label-conditioned diffusion generator per site + the FedAvg segmentation model",
)
JOIN_GENERATOR_KIND = ResultKind(
    name=JOIN_GENERATOR, version=1, load=result_from_checkpoint, options=(DOMAIN,),
    summary="FedST-join generator: one federated diffusion generator with a domain vector + the FedAvg segmentation model",
)
