"""Every medflare job as a FLARE 2.9 Recipe (see :mod:`medflare.common.recipe`); ``jobs/<name>/`` is each one's export.

    medflare run fedsm -n 4                       # the recipe in FLARE's SimEnv (medflare.jobs.run)
    python -c "from medflare.recipes import FedSMRecipe; from nvflare.recipe import SimEnv; FedSMRecipe().execute(SimEnv(num_clients=4))"

``RECIPES`` maps a job folder name to its recipe class (defaults = the shipped job folder). Importing this module
imports no algorithm (nor torch): a recipe's module is imported when its class is first asked for, so the job names
are known at once (``medflare run`` checks a name before anything heavy loads).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module

#: job name -> (module, class) of its recipe
WHERE = {
    "fedavg": ("medflare.baselines.recipe", "FedAvgRecipe"),
    "fedprox": ("medflare.baselines.recipe", "FedProxRecipe"),
    "scaffold": ("medflare.baselines.recipe", "ScaffoldRecipe"),
    "fedsm": ("medflare.fedsm.recipe", "FedSMRecipe"),
    "fedvck": ("medflare.fedvck.recipe", "FedVCKRecipe"),
    "fediod": ("medflare.fediod.recipe", "FedIODRecipe"),
    "fediod_seg": ("medflare.fediod.recipe", "FedIODSegRecipe"),
    "fedst_separate": ("medflare.fedst.recipe", "FedSTSeparateRecipe"),
    "fedst_join": ("medflare.fedst.recipe", "FedSTJoinRecipe"),
}


class _Recipes(Mapping):
    """``{job name: recipe class}``, each class imported on first use."""

    def __getitem__(self, name: str) -> type:
        module, cls = WHERE[name]
        return getattr(import_module(module), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(WHERE)

    def __len__(self) -> int:
        return len(WHERE)


RECIPES: Mapping[str, type] = _Recipes()

__all__ = ["RECIPES", "WHERE", *(cls for _, cls in WHERE.values())]


def __getattr__(name: str) -> type:
    """``from medflare.recipes import FedSMRecipe``: the class, imported now."""
    for module, cls in WHERE.values():
        if cls == name:
            return getattr(import_module(module), cls)
    raise AttributeError(f"module 'medflare.recipes' has no attribute '{name}'")
