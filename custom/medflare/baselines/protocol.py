"""What the FedAvg, FedProx and SCAFFOLD server and sites exchange: the task name, the reply's parts, the manifest.

Server -> site, task ``train`` (every round): the global model as FULL weights, FLARE's way (FedAvg / Scaffold
workflows); FedProx's ``fedprox_mu`` and SCAFFOLD's global controls ride in the task meta as FLARE puts them.
Task ``validate`` (once, after the last round): the final global model, which the site only scores (issue 32: so
that the best-model selector judges the final model too); the reply holds the scores alone.

Site -> server: the model's change in the round as a WEIGHT_DIFF DXO (part :data:`UPDATE`), the received global
model's validation scores (FLARE's ``initial_metrics``, which a stock ``IntimeModelSelector`` reads) and, for
SCAFFOLD, the change of the site's control variate (FLARE's ``SCAFFOLD_CTRL_DIFF``, a WEIGHT_DIFF of its own).
"""

from nvflare.apis.dxo import MetaKey
from nvflare.app_common.app_constant import AlgorithmConstants

from medflare.common.egress import Send, declare

TASK_TRAIN = "train"
#: the task that scores the final global model and trains nothing (:meth:`medflare.baselines.controller._Resilient.validate_final`)
TASK_VALIDATE = "validate"

#: name of the weight-diff part of a reply
UPDATE = "update"


def manifest(scaffold: bool = False) -> dict:
    """What a baseline site sends per task (:func:`medflare.common.egress.declare`); ``scaffold`` adds the control diff."""
    sends = [Send(UPDATE, "WEIGHT_DIFF", "the local model's change in this round", models=1),
             Send(MetaKey.INITIAL_METRICS, "METRICS", "validation scores of the received global model (numbers)")]
    if scaffold:
        sends.append(Send(AlgorithmConstants.SCAFFOLD_CTRL_DIFF, "WEIGHT_DIFF", "the change of the site's control variate",
                          models=1))
    final = [Send(MetaKey.INITIAL_METRICS, "METRICS", "validation scores of the final global model (numbers)", cadence="once")]
    return declare({TASK_TRAIN: sends, TASK_VALIDATE: final})
