"""Sites ask for their next task when the server has one, instead of polling into FLARE's retry sleeps.

After a site sends a task's result it asks the server for the next task at once. Usually the server is
still waiting for the other sites, or aggregating, and answers "try again"; the site then sleeps before
asking again: 0.5 s fixed in FLARE's simulator (``simulator_worker.py``), the server's
``task_request_interval`` in POC and production. Whichever poll comes first after the next task is ready
decides when the site starts, so every round pays up to that sleep on top of the slowest site's compute
(benchmarks/RESULTS.md: 0.5 s of the 0.5 s overhead per round in the simulator).

This pair of components removes the guesswork with FLARE's own auxiliary messages:

* :class:`TaskReadyResponder` (server) answers the topic ``medflare.task_ready`` with whether the running
  workflow has a standing task this site has not been sent yet (a look at FLARE's task list, no task
  is assigned by it, nothing of the task is sent);
* :class:`WaitForNextTask` (site) handles ``AFTER_SEND_TASK_RESULT``: it asks that question every
  ``poll_interval`` seconds (growing to ``max_interval`` while the site waits for slow peers) and returns
  as soon as the answer is yes, or after ``max_wait`` seconds, or when the server does not know the topic
  (a job or a FLARE version without the responder); FLARE then fetches the task as it always does.
  It does not wait in a simulator that runs fewer sites at once than it has (``-t`` below ``-n``) or
  does not say how many it has: there the simulator runs the next site's task in the thread that would
  wait, so waiting for the round to finish would only hold the round up.

Two more waits sit between a round's last result and the next round's task, and the responder removes
the first: FLARE 2.9 creates every workflow's task monitor (``WFCommServer``) with its default
``task_check_period`` of 0.2 s and hands the workflow's own ``task_check_period`` to an attribute the
monitor never reads, so a workflow notices its finished task up to 0.2 s late whatever its config says.
At START_RUN the responder gives each workflow's monitor the workflow's period. The second is the
server's ``task_request_interval``, which FLARE also sends with every task as the time the site sleeps
after finishing it before it asks for the next; the jobs set it to 0.02 s
(:data:`medflare.common.recipe.SERVER_SETTINGS`): with the wait above, asking early costs nothing.

The messages carry no data of the site (an empty Shareable each way, a boolean header back), so they
are not a side channel for anything a site's privacy filters govern. The responder reads the task list of
FLARE 2.9's ``WFCommServer`` (``_tasks``/``_task_lock``, not a public API): if it is not there, it answers
"ready", which makes the site fall back to FLARE's own polling, never wait.
"""

from __future__ import annotations

import time

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply

from medflare.common.component import keep_args
from medflare.common.compute import simulator_counts

TOPIC = "medflare.task_ready"
READY = "medflare_task_ready"


def pending_for(tasks, site: str) -> bool:
    """Whether one of FLARE's standing ``tasks`` can still be sent to ``site`` (targets it, and was not sent to it)."""
    for task in tasks:
        if task.completion_status is not None:
            continue
        if task.targets and site not in task.targets:
            continue
        if site not in task.last_client_task_map:
            return True
    return False


class TaskReadyResponder(FLComponent):
    """Server side: answers ``medflare.task_ready`` (see the module docstring). No arguments."""

    def __init__(self):
        super().__init__()
        keep_args(self)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            fl_ctx.get_engine().register_aux_message_handler(TOPIC, self._answer)
            self._apply_check_periods(fl_ctx)

    def _apply_check_periods(self, fl_ctx: FLContext) -> None:
        """Give each workflow's task monitor the workflow's own ``task_check_period`` (FLARE 2.9 drops it)."""
        runner = fl_ctx.get_prop(FLContextKey.RUNNER)
        for wf in getattr(getattr(runner, "config", None), "workflows", None) or []:
            controller = getattr(wf, "controller", None)
            comm = getattr(controller, "communicator", None)
            period = getattr(controller, "_task_check_period", None)
            if comm is not None and hasattr(comm, "_task_check_period") and isinstance(period, (int, float)) and period > 0:
                comm._task_check_period = period

    def _answer(self, topic: str, request: Shareable, fl_ctx: FLContext) -> Shareable:
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer is not None else None
        reply = make_reply(ReturnCode.OK)
        reply.set_header(READY, self._ready(site, fl_ctx))
        return reply

    @staticmethod
    def _ready(site: str | None, fl_ctx: FLContext) -> bool:
        """Whether the running workflow has a task for ``site``; True when that cannot be told."""
        runner = fl_ctx.get_prop(FLContextKey.RUNNER)
        wf = getattr(runner, "current_wf", None)
        comm = getattr(getattr(wf, "controller", None), "communicator", None)
        lock, tasks = getattr(comm, "_task_lock", None), getattr(comm, "_tasks", None)
        if not site or lock is None or tasks is None:
            return True  # no workflow running (the job is ending) or a FLARE without this task list: do not hold the site
        with lock:
            return pending_for(list(tasks), site)


class WaitForNextTask(FLComponent):
    """Site side: after sending a result, wait until the server has this site's next task (module docstring).

    Args:
        poll_interval: seconds between the first questions. Default 0.02.
        max_interval: the interval grows by half each question up to this many seconds. Default 0.1.
        max_wait: give up waiting (FLARE polls as usual) after this many seconds. Default 600.
    """

    def __init__(self, poll_interval: float = 0.02, max_interval: float = 0.1, max_wait: float = 600.0):
        super().__init__()
        keep_args(self, poll_interval=poll_interval, max_interval=max_interval, max_wait=max_wait)
        self._enabled = True

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            counts = simulator_counts(fl_ctx.get_prop(FLContextKey.ARGS))
            self._enabled = counts is None or (counts[1] is not None and counts[0] >= counts[1])
            if not self._enabled:
                self.log_info(fl_ctx, "the simulator runs fewer sites at once than it has (-t < -n): FLARE's polling, no wait")
        elif event_type == EventType.AFTER_SEND_TASK_RESULT and self._enabled:
            self.wait(fl_ctx)

    def _ask(self, fl_ctx: FLContext) -> bool:
        """True when the server has a task for this site, or cannot say (then FLARE's polling takes over)."""
        replies = fl_ctx.get_engine().send_aux_request(targets=None, topic=TOPIC, request=Shareable(), timeout=5.0,
                                                       fl_ctx=fl_ctx, optional=True)
        reply = next(iter(replies.values()), None) if isinstance(replies, dict) else None
        if not isinstance(reply, Shareable) or reply.get_return_code() != ReturnCode.OK:
            return True
        return bool(reply.get_header(READY, True))

    def wait(self, fl_ctx: FLContext) -> float:
        """Block until the server has the next task for this site; returns the seconds waited."""
        start, interval = time.perf_counter(), self.poll_interval
        abort = fl_ctx.get_run_abort_signal()
        while time.perf_counter() - start < self.max_wait:
            if (abort is not None and abort.triggered) or self._ask(fl_ctx):
                break
            time.sleep(interval)
            interval = min(self.max_interval, interval * 1.5)
        return time.perf_counter() - start
