"""Every medflare job as a FLARE 2.9 Recipe (see :mod:`medflare.common.recipe`); ``jobs/<name>/`` is each one's export.

    python -c "from medflare.recipes import FedSMRecipe; from nvflare.recipe import SimEnv; FedSMRecipe().execute(SimEnv(num_clients=4))"

``RECIPES`` maps a job folder name to its recipe class (defaults = the shipped job folder).
"""

from medflare.baselines.recipe import FedAvgRecipe, FedProxRecipe, ScaffoldRecipe
from medflare.fediod.recipe import FedIODRecipe, FedIODSegRecipe
from medflare.fedsm.recipe import FedSMRecipe
from medflare.fedst.recipe import FedSTJoinRecipe, FedSTSeparateRecipe
from medflare.fedvck.recipe import FedVCKRecipe

RECIPES = {
    "fedavg": FedAvgRecipe,
    "fedprox": FedProxRecipe,
    "scaffold": ScaffoldRecipe,
    "fedsm": FedSMRecipe,
    "fedvck": FedVCKRecipe,
    "fediod": FedIODRecipe,
    "fediod_seg": FedIODSegRecipe,
    "fedst_separate": FedSTSeparateRecipe,
    "fedst_join": FedSTJoinRecipe,
}

__all__ = ["RECIPES", "FedAvgRecipe", "FedIODRecipe", "FedIODSegRecipe", "FedProxRecipe", "FedSMRecipe", "FedSTJoinRecipe",
           "FedSTSeparateRecipe", "FedVCKRecipe", "ScaffoldRecipe"]
