"""Sites wait for their next task instead of polling into FLARE's retry sleeps (medflare.common.task_wait)."""

from __future__ import annotations

import threading
import types

from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply

from medflare.common.task_wait import READY, TaskReadyResponder, WaitForNextTask, pending_for


def _task(targets, sent_to=(), done=False):
    return types.SimpleNamespace(targets=list(targets), last_client_task_map={s: object() for s in sent_to},
                                 completion_status="done" if done else None)


def test_a_task_is_pending_for_a_target_it_was_not_sent_to():
    assert pending_for([_task(["site-1", "site-2"])], "site-1")
    assert not pending_for([_task(["site-1", "site-2"], sent_to=["site-1"])], "site-1")  # answered this round's task
    assert not pending_for([_task(["site-2"])], "site-1")  # another site's own task (FedSM: one task per site)
    assert not pending_for([_task(["site-1"], done=True)], "site-1")
    assert pending_for([_task([])], "site-9")  # targets "*": anyone
    assert not pending_for([], "site-1")
    # the old round's task still standing (monitor not run yet) and the new one scheduled: ready
    assert pending_for([_task(["site-1"], sent_to=["site-1"]), _task(["site-1"])], "site-1")


def _server_ctx(tasks, site="site-1"):
    comm = types.SimpleNamespace(_tasks=tasks, _task_lock=threading.Lock(), _task_check_period=0.2)
    controller = types.SimpleNamespace(communicator=comm, _task_check_period=0.02)
    runner = types.SimpleNamespace(current_wf=types.SimpleNamespace(controller=controller),
                                   config=types.SimpleNamespace(workflows=[types.SimpleNamespace(controller=controller)]))
    ctx = FLContext()
    ctx.set_prop(FLContextKey.RUNNER, runner, private=True, sticky=False)
    peer = FLContext()
    peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    ctx.set_peer_context(peer)
    return ctx, comm


def test_the_responder_answers_from_the_running_workflows_tasks_and_fixes_the_check_period():
    responder = TaskReadyResponder()
    ctx, comm = _server_ctx([_task(["site-1"], sent_to=["site-1"])])
    assert responder._answer("t", Shareable(), ctx).get_header(READY) is False
    comm._tasks.append(_task(["site-1"]))
    assert responder._answer("t", Shareable(), ctx).get_header(READY) is True
    responder._apply_check_periods(ctx)
    assert comm._task_check_period == 0.02  # the workflow's own period, which FLARE 2.9 leaves at 0.2 s
    # no workflow running (the job is ending): never hold a site
    ctx.set_prop(FLContextKey.RUNNER, types.SimpleNamespace(current_wf=None), private=True, sticky=False)
    assert responder._answer("t", Shareable(), ctx).get_header(READY) is True


class _Engine:
    """Answers the site's question with a scripted sequence of (return code, ready) replies."""

    def __init__(self, answers):
        self.answers, self.asked = list(answers), 0

    def send_aux_request(self, targets, topic, request, timeout, fl_ctx, optional=False):
        self.asked += 1
        rc, ready = self.answers.pop(0) if self.answers else (ReturnCode.OK, True)
        reply = make_reply(rc)
        if ready is not None:
            reply.set_header(READY, ready)
        return {"server": reply}


def _site_ctx(engine):
    ctx = types.SimpleNamespace(get_engine=lambda: engine, get_run_abort_signal=lambda: None)
    return ctx


def test_the_site_waits_until_the_server_has_its_task():
    engine = _Engine([(ReturnCode.OK, False)] * 3 + [(ReturnCode.OK, True)])
    WaitForNextTask(poll_interval=0.001, max_interval=0.002).wait(_site_ctx(engine))
    assert engine.asked == 4


def test_the_site_does_not_wait_when_the_server_cannot_say_or_too_long():
    engine = _Engine([(ReturnCode.TOPIC_UNKNOWN, None)])  # a job without the responder
    WaitForNextTask(poll_interval=0.001).wait(_site_ctx(engine))
    assert engine.asked == 1
    engine = _Engine([(ReturnCode.OK, False)] * 1000)
    waited = WaitForNextTask(poll_interval=0.01, max_interval=0.01, max_wait=0.05).wait(_site_ctx(engine))
    assert 0.05 <= waited < 1.0 and engine.asked < 20


def test_no_wait_where_the_simulator_runs_sites_in_turns():
    import argparse

    from nvflare.apis.event_type import EventType

    def started(**args):
        comp, ctx = WaitForNextTask(), FLContext()
        ctx.set_prop(FLContextKey.ARGS, argparse.Namespace(gpu=None, clients=None, **args), private=True, sticky=False)
        comp.handle_event(EventType.START_RUN, ctx)
        return comp._enabled

    assert started(threads=4, n_clients=4)  # every site its own process: wait
    assert not started(threads=1, n_clients=4)  # sites take turns in one thread: waiting would hold the round
    assert not started(threads=2, n_clients=None)  # site names from the job: cannot tell, do not wait
    assert started(workspace="ws")  # POC / production (no simulator arguments): wait
