"""The command-line options of FedSM's result kinds (torch-free: ``medflare evaluate --help`` imports only this)."""

from medflare import ConfigError
from medflare.common.options import KindOptions, Option


def _gammas(text: str) -> list[float]:
    try:
        gammas = [float(g) for g in text.split(",")]
    except ValueError:
        raise ConfigError(f"--gamma must be comma-separated numbers in [0, 1], got '{text}'") from None
    return gammas


GAMMA = Option("gamma", "typicality threshold(s) of Algorithm 2, each for every site, comma-separated for a sweep "
                        "(default: the job's, one per site where the run chose them from validation): "
                        "about the share of a seen site's cases sent to the global model; 0 = always a personalised model, "
                        "1 = the global model alone", parse=_gammas, commands=("evaluate", "predict"))
SUPER_MODEL_OPTIONS = KindOptions("FedSM results", (GAMMA,))
