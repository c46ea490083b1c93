"""The FedSM super model as one network: global model, K personalised models and the selector in one container.

:func:`super_model_network` builds it (an ``nn.ModuleDict`` with submodules ``global``, ``person_<i>`` in selector
order, ``select``; names from :mod:`.protocol`, so its flat state has the payload's keys). The persistor
(:mod:`.persistor`) saves it, :mod:`.results` reads it back (kind ``fedsm_super_model``).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from torch import nn

from medflare.fedsm import protocol as P
from medflare.fedsm.selector import build_selector
from medflare.nets import build_from_spec


def super_model_network(model_spec: Mapping[str, Any], sites: Sequence[str], selector_spec: Mapping[str, Any],
                        initial: nn.Module | None = None) -> nn.ModuleDict:
    """The container: ``initial`` (default a fresh network of ``model_spec``) as ``global``, copied as each
    ``person_<i>``, and the selector.

    Every personalised model starts as the global model (as in the reference); the selector's stem is a copy
    of the global model's encoder and it has no site Gaussians yet (every case goes to the global model).
    """
    net = initial if initial is not None else build_from_spec(model_spec)
    parts: dict[str, nn.Module] = {P.GLOBAL: net}
    parts.update({P.person_key(i): copy.deepcopy(net) for i in range(len(sites))})
    select = build_selector(selector_spec)
    select.set_stem(net)
    parts[P.SELECT] = select
    return nn.ModuleDict(parts)
