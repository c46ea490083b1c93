"""In FLARE's simulator, a site's privacy scope runs at the site, as it does in POC and production.

Why: FLARE 2.9's simulator gives its clients no privacy scope. Its client run manager
(``nvflare.private.fed.simulator.simulator_app_runner.SimulatorClientRunManager``) builds the job context from the
job's meta alone, so ``FLContextKey.SCOPE_OBJECT`` is never set at a site and the scope's task result filters
(``local/privacy.json``: DXOBlocker, PercentilePrivacy, medflare's CondensedSetFilter, ...) never run there. Its
server run manager does set it, from the same ``local/privacy.json`` (the simulator copies ``WS/local`` into every
site's and the server's ``local/``), so the filters ran at the server, after the payload had left the site: the
result the workflow saw was filtered, but the site's egress was not, one shared filter instance served every site
(its random draws in the order the replies arrived: FedVCK's e2e accuracy differed run to run, 0.274-0.394), and a
DXOBlocker refusal was the server's, not the site's.

What :class:`SimulatorSiteScope` does, only when the run is a simulation (FLARE's ``SIMULATE_MODE`` at a site, the
simulator's server engine at the server):

- at a site, at START_RUN: the scope the job asks for (meta ``scope``; none: the site's default scope) from the
  site's privacy policy, set in the run's context as FLARE's own client run manager sets it in POC and production,
  so FLARE applies its filters to every task result before the reply leaves; a scope the policy does not define
  ends the run with the message FLARE gives when it refuses such a job;
- at the server, at START_RUN: the scope cleared, because the simulator's ``local/privacy.json`` is the sites'
  policy (a POC or production server has its own, which this component never touches outside the simulator), so the
  filters do not run a second time on what the sites already filtered.

Outside the simulator it does nothing. It uses FLARE's ``PrivacyService`` (``nvflare.private``), the registry of
the policy FLARE itself builds from the site's ``local/privacy.json``; FLARE 2.9 is pinned (requirements/constraints.txt).
"""

from __future__ import annotations

import sys

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.job_def import JobMetaKey
from nvflare.private.privacy_manager import PrivacyService  # FLARE's registry of the site's privacy.json

#: the context keys FLARE's run managers set for a job's scope (nvflare.private.fed.utils.fed_utils)
SCOPE_KEYS = (FLContextKey.JOB_SCOPE_NAME, FLContextKey.EFFECTIVE_JOB_SCOPE_NAME, FLContextKey.SCOPE_PROPERTIES,
              FLContextKey.SCOPE_OBJECT)


#: the module of FLARE's simulator server; loaded only in a process the simulator started
SIMULATOR_SERVER_MODULE = "nvflare.private.fed.simulator.simulator_server"


def _simulator_server(fl_ctx: FLContext) -> bool:
    """Whether this is the simulator's server: its engine class, looked up only where the simulator has loaded it (a POC
    or production server never imports the simulator for this check)."""
    module = sys.modules.get(SIMULATOR_SERVER_MODULE)
    engine_class = getattr(module, "SimulatorServerEngine", None)
    return engine_class is not None and isinstance(fl_ctx.get_engine(), engine_class)


class SimulatorSiteScope(FLComponent):
    """Makes the FLARE simulator apply a site's privacy scope at the site (see the module docstring); a client and a
    server component of every medflare job, a no-op outside the simulator."""

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.START_RUN:
            return
        if fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False):
            self._apply_at_site(fl_ctx)
        elif _simulator_server(fl_ctx) and fl_ctx.get_prop(FLContextKey.SCOPE_OBJECT) is not None:
            name = fl_ctx.get_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME)
            for key in SCOPE_KEYS:
                fl_ctx.set_prop(key, None, private=True, sticky=True)
            self.log_info(fl_ctx, f"simulator: privacy scope '{name}' runs at the sites, not again at the server")

    def _apply_at_site(self, fl_ctx: FLContext) -> None:
        if fl_ctx.get_prop(FLContextKey.SCOPE_OBJECT) is not None:
            return  # FLARE set it already (a later FLARE whose simulator does)
        if not PrivacyService.is_policy_defined():
            return  # no local/privacy.json: FLARE applies no scope either
        meta = fl_ctx.get_prop(FLContextKey.JOB_META) or {}
        name = meta.get(JobMetaKey.SCOPE.value, "") if isinstance(meta, dict) else ""
        scope = PrivacyService.get_scope(name)
        if scope is None:
            self.system_panic(f"privacy scope '{name}' is not allowed: the site's local/privacy.json defines no such scope "
                              f"(FLARE refuses this job at the site in POC and production)", fl_ctx)
            return
        for key, value in zip(SCOPE_KEYS, (name, scope.name, scope.props, scope)):
            fl_ctx.set_prop(key, value, private=True, sticky=True)
        self.log_info(fl_ctx, f"simulator: privacy scope '{scope.name}' applies at this site, to every task result "
                              f"before it leaves")
