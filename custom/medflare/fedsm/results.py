"""The result kinds FedSM saves (``medflare.result_kinds`` entry points), for ``medflare evaluate`` / ``predict``
(see :mod:`medflare.common.results`)."""

from medflare import ConfigError
from medflare.common.results import Option, ResultKind
from medflare.fedsm.supermodel import KIND, VERSION, super_model_from_checkpoint


def _gammas(text: str) -> list[float]:
    try:
        return [float(g) for g in text.split(",")]
    except ValueError:
        raise ConfigError(f"--gamma must be comma-separated numbers in [0, 1], got '{text}'") from None


SUPER_MODEL = ResultKind(
    name=KIND,
    version=VERSION,
    summary="FedSM super model: global + per-site personalised models + model selector (Algorithm 2)",
    load=super_model_from_checkpoint,
    options=(Option("gamma", "typicality threshold(s) of Algorithm 2, comma-separated for a sweep (default: the job's): "
                    "about the share of a seen site's cases sent to the global model; 0 = always a personalised model, "
                    "1 = the global model alone", parse=_gammas),),
)
