"""The result kind FedVCK saves (a ``medflare.result_kinds`` entry point), for ``medflare show / evaluate / predict / sample``
(see :mod:`medflare.common.results`)."""

from medflare.common.results import ResultKind
from medflare.fedvck.checkpoint import KIND, load_fedvck_result

FEDVCK_RESULT = ResultKind(
    name=KIND,
    version=1,
    summary="FedVCK: global model trained on the sites' condensed sets, its projector, and the condensed sets kept",
    load=load_fedvck_result,
)
