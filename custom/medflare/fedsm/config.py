"""FedSM's settings: the ``fedsm`` section of a preset, read by the server's workflow.

SoftPull's lambda, the selector, the inference threshold gamma and FedSM-extra are algorithm settings, not wiring, so
they live in the preset like every algorithm's: a job folder sets them in its ``overrides``
(``{"fedsm": {"gamma": 0.1}}``), ``medflare run fedsm --set fedsm.extra_rounds=2`` on the command line, and a
paper-scale run in a preset. A preset without a ``fedsm`` section runs with the defaults below (the values the job
folder ran with before they moved here).
"""

from __future__ import annotations

from typing import Any, Mapping

from medflare import ConfigError
from medflare.settings import POSITIVE, Bool, Check, Int, Number, Section, section, setting

#: Algorithm 2's default threshold (also what ``medflare evaluate`` uses for a super model that records none)
DEFAULT_GAMMA = 0.05
#: the selector's arguments a job may set, with their rules (the rest come from the preset's network and the run)
SELECTOR_RULES = {"levels": Int(1), "shrinkage": Number(0.0, 1.0)}


def _selector(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{key}' must be a dict, got {value!r}")
    unknown = [k for k in value if k not in SELECTOR_RULES]
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'{key}.{k}' for k in unknown]} in '{key}' (valid keys: {', '.join(SELECTOR_RULES)})")
    return {k: SELECTOR_RULES[k](f"{key}.{k}", v) for k, v in value.items()}


@section("fedsm")
class FedSMConfig(Section):
    """FedSM's algorithm settings (Xu et al. 2022).

    Keys:
        softpull_lambda: lambda of Eq. 11, in [1/K, 1] for K sites (checked when the sites are known); 1/K = FedAvg,
            1 = local training. Default 0.7 (the paper's, low-similarity sites).
        gamma: Algorithm 2's threshold on the selector's typicality, used for the scores the sites report and stored in
            the super model as the default of ``medflare evaluate``: about the share of a seen site's cases sent to the
            global model (jobs/fedsm/README.md, "Choosing gamma"), in [0, 1]. Default 0.05.
        gamma_from_validation: after the last round, replace ``gamma`` in the saved super model by one threshold per
            site from :data:`medflare.fedsm.scoring.GAMMA_GRID`, each the one whose cases (those most typical of that
            site) score best on the sites' validation cases, as seen sites and left out one at a time as if new
            (:func:`medflare.fedsm.scoring.choose_site_gammas`; one for all when a site sends no per-site shares);
            false: keep ``gamma``. Default true.
        selector: arguments of :class:`~medflare.fedsm.selector.EncoderGaussianSelector`: ``levels`` (encoder levels
            read, >= 1; the selector's default 2) and ``shrinkage`` (covariance shrinkage in [0, 1]; default 0.2).
            Default {} (both at the selector's defaults).
        extra_rounds: FedSM-extra rounds after the main ones; each is one server-side Adam step of the selector head
            (K + 1 outputs, 0 = global model) on Eq. 1 labels; 0 = plain FedSM. Default 0.
        head_lr: Adam learning rate of the FedSM-extra head on the server, > 0. Default 0.05.
    """

    softpull_lambda: float = setting(0.7, Number(0.0, 1.0, low_open=True))
    gamma: float = setting(DEFAULT_GAMMA, Number(0.0, 1.0))
    gamma_from_validation: bool = setting(True, Bool())
    selector: dict = setting({}, Check(_selector))
    extra_rounds: int = setting(0, Int(0))
    head_lr: float = setting(0.05, POSITIVE)
