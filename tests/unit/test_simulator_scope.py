"""medflare.common.simulator_scope: in FLARE's simulator a site's privacy scope is set at the site (FLARE 2.9's simulator
sets none there and applies the scope at the server instead), and cleared at the simulator's server; outside the
simulator nothing changes. The e2e FedVCK test checks the effect in a real simulator run (the filter logs at the sites)."""

from __future__ import annotations

import sys

import pytest
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext, FLContextManager
from nvflare.private.privacy_manager import PrivacyManager, PrivacyService, Scope

from medflare.common.simulator_scope import SCOPE_KEYS, SimulatorSiteScope


def _scope(name: str) -> Scope:
    scope = Scope()
    scope.set_name(name)
    scope.set_props({"description": name})
    return scope


@pytest.fixture()
def policy():
    """A site policy with scopes 'public' (the default) and 'condensed', as FLARE builds it from local/privacy.json."""
    before = PrivacyService.manager
    PrivacyService.initialize(PrivacyManager(scopes=[_scope("public"), _scope("condensed")], default_scope_name="public", components={}))
    yield
    PrivacyService.initialize(before)


def _ctx(simulate: bool, meta: dict, stickers: dict | None = None) -> FLContext:
    private = {FLContextKey.JOB_META: meta, **({FLContextKey.SIMULATE_MODE: True} if simulate else {}), **(stickers or {})}
    return FLContextManager(identity_name="site-1", private_stickers=private).new_context()


def test_a_simulated_site_gets_the_scope_its_job_asks_for_or_its_default(policy):
    for meta, expected in (({"scope": "condensed"}, "condensed"), ({}, "public")):
        ctx = _ctx(True, meta)
        SimulatorSiteScope().handle_event(EventType.START_RUN, ctx)
        scope = ctx.get_prop(FLContextKey.SCOPE_OBJECT)
        assert scope is not None and scope.name == expected
        assert ctx.get_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME) == expected
        assert ctx.get_prop(FLContextKey.SCOPE_PROPERTIES) == {"description": expected}


def test_an_undefined_scope_ends_the_simulated_run_as_flare_refuses_the_job(policy, monkeypatch):
    panics = []
    comp = SimulatorSiteScope()
    monkeypatch.setattr(comp, "system_panic", lambda reason, fl_ctx: panics.append(reason))
    ctx = _ctx(True, {"scope": "no-such-scope"})
    comp.handle_event(EventType.START_RUN, ctx)
    assert ctx.get_prop(FLContextKey.SCOPE_OBJECT) is None
    assert len(panics) == 1 and "privacy scope 'no-such-scope' is not allowed" in panics[0]


def test_nothing_changes_outside_the_simulator_or_without_a_policy(policy):
    real = _ctx(False, {"scope": "condensed"})  # POC / production: FLARE's run manager sets the scope itself
    SimulatorSiteScope().handle_event(EventType.START_RUN, real)
    assert all(real.get_prop(k) is None for k in SCOPE_KEYS)
    already = _ctx(True, {"scope": "condensed"}, {FLContextKey.SCOPE_OBJECT: _scope("strict")})
    SimulatorSiteScope().handle_event(EventType.START_RUN, already)
    assert already.get_prop(FLContextKey.SCOPE_OBJECT).name == "strict"
    PrivacyService.initialize(PrivacyManager(scopes=None, default_scope_name=None, components=None))
    bare = _ctx(True, {"scope": "condensed"})
    SimulatorSiteScope().handle_event(EventType.START_RUN, bare)
    assert bare.get_prop(FLContextKey.SCOPE_OBJECT) is None


def test_the_simulators_server_drops_the_scope_and_a_real_server_keeps_it(monkeypatch):
    import types

    from medflare.common.simulator_scope import SIMULATOR_SERVER_MODULE

    class SimulatorServerEngine:  # stands in for FLARE's, looked up where the simulator loaded it
        pass

    scoped = {FLContextKey.SCOPE_OBJECT: _scope("condensed"), FLContextKey.EFFECTIVE_JOB_SCOPE_NAME: "condensed"}
    real = FLContextManager(engine=object(), identity_name="server", private_stickers=dict(scoped)).new_context()
    monkeypatch.setitem(sys.modules, SIMULATOR_SERVER_MODULE, types.SimpleNamespace(SimulatorServerEngine=SimulatorServerEngine))
    SimulatorSiteScope().handle_event(EventType.START_RUN, real)  # a POC / production server: its own policy stays
    assert real.get_prop(FLContextKey.SCOPE_OBJECT).name == "condensed"
    sim = FLContextManager(engine=SimulatorServerEngine(), identity_name="server", private_stickers=dict(scoped)).new_context()
    SimulatorSiteScope().handle_event(EventType.START_RUN, sim)
    assert all(sim.get_prop(k) is None for k in SCOPE_KEYS)
