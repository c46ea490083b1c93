"""The baselines' settings: FedAvg and SCAFFOLD have none of their own (only the shared ``train`` and ``eval`` sections of
every preset, :class:`medflare.presets.TrainSettings` / :class:`medflare.presets.EvalSettings`); FedProx has ``fedprox``.

FedProx's mu travels the FLARE way: the server's ``FedAvg(fedprox_mu=...)`` puts it in every task's meta and the sites
add ``PTFedProxLoss`` with it (:mod:`medflare.baselines.corrections`). The FedProx recipe takes that value from this
section (``medflare run fedprox --set fedprox.mu=0.1``); a job whose preset holds the section is checked by every site
against the mu its tasks carry, so a job-folder override the workflow would not send is refused, not ignored.
"""

from __future__ import annotations

from medflare.settings import NON_NEGATIVE, Section, section, setting


@section("fedprox")
class FedProxConfig(Section):
    """FedProx (Li et al. 2020).

    Keys:
        mu: weight of the proximal term mu/2 * ||w - w_global||^2 in every site's local loss, >= 0 (the FedProx paper
            sweeps 0.001 to 1). Default 0.01.
    """

    mu: float = setting(0.01, NON_NEGATIVE)
