"""The result kinds FedSM saves (``medflare.result_kinds`` entry points), for ``medflare evaluate`` / ``predict``
(see :mod:`medflare.common.results`)."""

from medflare.common.results import ResultKind
from medflare.fedsm.options import SUPER_MODEL_OPTIONS
from medflare.fedsm.supermodel import KIND, VERSION, super_model_from_checkpoint


SUPER_MODEL = ResultKind(
    name=KIND,
    version=VERSION,
    summary="FedSM super model: global + per-site personalised models + model selector (Algorithm 2)",
    load=super_model_from_checkpoint,
    options=SUPER_MODEL_OPTIONS.options,
)
