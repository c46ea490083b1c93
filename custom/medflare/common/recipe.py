"""FLARE 2.9 recipes for medflare jobs: one Recipe class per job, and the job folders under ``jobs/`` are their export.

FLARE 2.9's entry point is a Recipe run in an environment (``SimEnv``, ``PocEnv``, ``ProdEnv``); the
classic job folder (``nvflare simulator jobs/<job>``, admin-console submission) stays first-class. To
keep one source of truth, ``python -m medflare.jobs.export`` regenerates ``jobs/<job>/`` from
the recipes and a test fails when a folder and its recipe's export differ, so a knob never exists in
one and not in the other.

:class:`JobRecipe` wires what every medflare job has besides its workflow and executor: the server's
TensorBoard receiver, the line naming the result file at the end of the run (:class:`~medflare.common.summary.RunSummary`), the sites' analytics-to-federated-event converter (scalars; what a site keeps goes to its
own receiver, :mod:`medflare.common.tracking`), the job's manifest of what its sites send, checked by every site
before a reply leaves (:class:`~medflare.common.egress.ManifestFilter`) and unpacked on the server
(:class:`~medflare.common.egress.Intake`), the privacy scope the job asks its sites for, the server's update guard
(:class:`~medflare.common.result_guard.UpdateGuard`, a result filter on every task: no NaN/Inf or outsized
update reaches a model), FLARE timings that keep the
per-round overhead at about 0.5 s instead of 2 s (benchmarks/RESULTS.md), sites that fetch their next task
when the server has it (:mod:`medflare.common.task_wait`: no retry sleeps), a check at START_RUN on every side that
the job's components name one preset, overrides and seed (:mod:`medflare.common.preset_check`), a site's privacy
scope applied at the site in FLARE's simulator too (:mod:`medflare.common.simulator_scope`), the package as an installed
app package (never copied into the job), and ``app/custom/README.md``, which makes the simulator treat
the job as bring-your-own-code so that it runs without a site-side class allow-list.

FLARE's own PyTorch recipes (``nvflare.app_opt.pt.recipes``) wrap a Client API training *script*; our
jobs use classic Executors that keep optimiser and SCAFFOLD state between rounds, so the baselines have
recipes of their own built the same way as FLARE's (a FedJob with FLARE's FedAvg / Scaffold workflow).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.job_config.api import FedJob
from nvflare.recipe.spec import Recipe

from medflare.common.egress import Intake, ManifestFilter
from medflare.common.preset_check import PresetCheck
from medflare.common.result_guard import UpdateGuard
from medflare.common.simulator_scope import SimulatorSiteScope
from medflare.common.summary import RunSummary
from medflare.common.task_wait import TaskReadyResponder, WaitForNextTask
from medflare.common.tracking import LOCAL_EVENT_TYPE, SERVER_EVENT_TYPE

#: FLARE timings of every medflare job (stock FLARE: 2 s idle wait per round; see benchmarks/RESULTS.md). Sites wait
#: for their next task (medflare.common.task_wait) before asking for it, so they may ask at once: FLARE sends
#: ``task_request_interval`` with each task as the sleep before the next request, and a site's
#: ``default_task_fetch_interval`` is its sleep when the server did not answer.
SERVER_SETTINGS = {"server": {"task_request_interval": 0.02}}
CLIENT_SETTINGS = {"default_task_fetch_interval": 0.02}
#: how often a FLARE workflow checks its standing tasks (stock 0.5 s): the latency from the last result to aggregation
TASK_CHECK_PERIOD = 0.02

CUSTOM_README = """# app/custom: deliberately holds no code

The medflare package is installed at every site with pip (see provisioning/README.md); no copy of it
lives in a job. This folder exists so that FLARE 2.9 treats the job as "bring your own code" and
builds its `medflare.*` components without a site-side `class_allow_list` entry, which is what lets
`nvflare simulator jobs/<job> -w WS -n N -t N` run in a fresh workspace.

A site that refuses BYOC jobs instead allows `medflare.` in its `local/resources.json`
(`app_configs/site/local/resources.json` is the template) and runs the job exported without this folder:
`cp -r jobs/<job> OUT && rm -r OUT/app/custom` (see provisioning/README.md).
"""


@lru_cache(maxsize=1)
def _custom_readme() -> str:
    """``app/custom/README.md`` as a file outside any package (FLARE copies a file on sys.path under its module path)."""
    folder = Path(tempfile.mkdtemp(prefix="medflare-job-"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "README.md").write_text(CUSTOM_README)
    return str(folder / "README.md")


class JobRecipe(Recipe):
    """A medflare job: a server workflow, server components, one client executor for ``tasks``, and the shared wiring.

    Args:
        name: job name (the folder name under jobs/). Required.
        workflow: the server workflow component (a Controller). Required.
        workflow_id: its component id. Required.
        executor: the client Executor. Required.
        tasks: task names the executor serves. Required.
        manifest: what the sites send per task (:func:`medflare.common.egress.declare`): every site refuses a reply
            holding anything else. Required.
        scope: the sites' privacy scope the job runs under (``"scope"`` of meta.json; a site whose privacy.json lacks it
            refuses the job): the safe default for what the job sends. Required.
        result_file: the file the job saves in the server's app folder (what ``medflare evaluate`` scores); the server's
            :class:`~medflare.common.summary.RunSummary` names it at the end of the run. Required.
        preset, overrides: the job's preset and overrides, which size the manifest's weight parts. Default none.
        server_components: ``{id: component}`` beside the workflow (persistor, model selector, ...). Default none.
        client_components: ``{id: component}`` beside the executor. Default none.
        min_clients: fewest sites the job needs to start. Default 2.
        more_executors: ``[(executor, tasks), ...]`` further client executors, each serving its own tasks (a job whose
            site work splits into several executors, e.g. FedST's generator training, sampling and segmentation). Default none.
        update_guard: the server's result filter on every task the sites serve. Default ``UpdateGuard()`` (its knobs
            ``max_norm_ratio`` and ``enabled`` are in the exported ``config_fed_server.json``).
        wire_filters: ``[(site filter, server filter, tasks), ...]`` a codec of the job's own on those tasks' results
            (e.g. :class:`~medflare.common.diff_quantizer.DiffQuantizer` / ``DiffDequantizer``): the site's runs after
            its privacy scope and before the manifest check, on ``tasks``; the server's after the sites' parts are
            unpacked and before the update guard, on every task (FLARE's chains may not overlap; it must pass through
            what it did not encode). Default none.
    """

    def __init__(
        self,
        name: str,
        *,
        workflow: Any,
        workflow_id: str,
        executor: Any,
        tasks: Sequence[str],
        manifest: Mapping[str, Any],
        scope: str,
        result_file: str,
        preset: str = "",
        overrides: Mapping[str, Any] | None = None,
        server_components: Mapping[str, Any] | None = None,
        client_components: Mapping[str, Any] | None = None,
        min_clients: int = 2,
        more_executors: Sequence[tuple[Any, Sequence[str]]] | None = None,
        update_guard: UpdateGuard | None = None,
        wire_filters: Sequence[tuple[Any, Any, Sequence[str]]] = (),
    ):
        job = FedJob(name=name, min_clients=min_clients, meta_props={"scope": scope})
        job.set_app_packages(["medflare"])  # installed at every site with pip: never copied into the job
        job.to_server(workflow, id=workflow_id)
        for comp_id, comp in (server_components or {}).items():
            job.to_server(comp, id=comp_id)
        job.to_server(TBAnalyticsReceiver(events=[SERVER_EVENT_TYPE]), id="tb_receiver")
        job.to_server(RunSummary(job=name, result_file=result_file), id="run_summary")
        job.to_server(TaskReadyResponder(), id="task_ready")
        job.to_server(PresetCheck(), id="preset_check")
        job.to_server(SimulatorSiteScope(), id="simulator_scope")
        job.to_clients(executor, tasks=list(tasks))
        for extra, extra_tasks in more_executors or ():
            job.to_clients(extra, tasks=list(extra_tasks))
        for comp_id, comp in (client_components or {}).items():
            job.to_clients(comp, id=comp_id)
        job.to_clients(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE], fed_event_prefix="fed."), id="event_to_fed")
        job.to_clients(TBAnalyticsReceiver(events=[LOCAL_EVENT_TYPE]), id="tb_site")  # what the site keeps at home
        job.to_clients(WaitForNextTask(), id="wait_for_next_task")
        job.to_clients(PresetCheck(), id="preset_check")
        job.to_clients(SimulatorSiteScope(), id="simulator_scope")  # the FLARE simulator: a site's scope at the site
        super().__init__(job)
        all_tasks = sorted({*tasks, *(t for _, extra_tasks in more_executors or () for t in extra_tasks)})  # a stable export
        undeclared = sorted(set(all_tasks) - set(manifest))
        if undeclared:
            raise ValueError(f"job '{name}': tasks {undeclared} have no entry in the manifest of what the sites send")
        self.manifest = dict(manifest)
        self.result_file = result_file
        for site_filter, _, wire_tasks in wire_filters:
            self.add_client_output_filter(site_filter, tasks=list(wire_tasks))
        for task in all_tasks:  # one entry per task: FLARE exports a multi-task entry's task list in set order
            self.add_client_output_filter(ManifestFilter(manifest, preset=preset, overrides=overrides), tasks=[task])
        self.add_server_input_filter(Intake(), tasks=all_tasks)  # the sites' parts as the workflows read them
        for _, server_filter, _ in wire_filters:  # FLARE's filter chains may not overlap: on every task, decoding what is encoded
            self.add_server_input_filter(server_filter, tasks=all_tasks)
        self.add_server_input_filter(update_guard or UpdateGuard(), tasks=all_tasks)
        self.add_server_config(dict(SERVER_SETTINGS))
        self.add_client_config(dict(CLIENT_SETTINGS))
        self.add_server_file(_custom_readme())
        self.add_client_file(_custom_readme())
