"""``medflare run <job> -n N``: a shipped job's FLARE 2.9 recipe run in FLARE's simulator environment (``SimEnv``).

The same recipe that ``jobs/<job>/`` is the export of (:data:`medflare.recipes.RECIPES`), with the user's settings
(``--preset``, ``--set key=value`` overrides of the preset, ``--rounds``), run by ``recipe.run(SimEnv(...))``: FLARE's
entry point in 2.9, not the deprecated ``nvflare simulator`` command (which stays working: ``nvflare simulator
jobs/<job> -w WS -n N -t N``). Every site keeps its own thread (threads = sites: the sites keep state between rounds).

The console shows the job's one line per round (:mod:`medflare.common.summary`) and FLARE's warnings and errors
(:func:`medflare.jobs.logs.run_log_config`; ``verbose`` shows FLARE's full concise console), then where the result is
and the ``medflare evaluate`` command that scores it. The full logs stay in the workspace.

The job name is checked before anything heavy is imported, and a misspelt one names the nearest job.
"""

from __future__ import annotations

import difflib
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from medflare import ConfigError, MedflareError
from medflare.recipes import RECIPES

#: where ``medflare run`` puts a job's workspace: ``<root>/<job>/`` (FLARE's SimEnv names the folder after the job)
DEFAULT_ROOT = "/tmp/medflare"


def check_job(name: str) -> str:
    """``name`` when it is a shipped job; else ConfigError naming the nearest job names and every job."""
    if name in RECIPES:
        return name
    near = difflib.get_close_matches(name, list(RECIPES), n=2, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    raise ConfigError(f"unknown job '{name}'{hint} (jobs: {', '.join(RECIPES)})")


def build_recipe(job: str, sites: int | None, *, preset: str | None = None, overrides: Mapping[str, Any] | None = None,
                 rounds: int | None = None, seed: int | None = None):
    """The job's recipe with the given settings (None = the shipped job folder's); with ``sites`` given, a FedAvg-like
    job asks all of them each round and a job of fewer sites than its ``min_clients`` starts with them. ConfigError
    names a bad setting (an unknown preset or override key)."""
    recipe_cls = RECIPES[check_job(job)]
    accepted = inspect.signature(recipe_cls.__init__).parameters
    kwargs: dict[str, Any] = {}
    if preset is not None:
        kwargs["preset"] = preset
    if overrides:
        kwargs["overrides"] = dict(overrides)
    if rounds is not None:
        kwargs["num_rounds"] = rounds
    if seed is not None:  # every shipped recipe seeds its persistor, executors and workflow with it
        kwargs["seed"] = int(seed)
    if sites is not None and "num_clients" in accepted:
        kwargs["num_clients"] = sites
    default_min = accepted["min_clients"].default if "min_clients" in accepted else None
    if sites is not None and isinstance(default_min, int) and sites < default_min:
        kwargs["min_clients"] = sites
    return recipe_cls(**kwargs)


def workspace_of(root: str | os.PathLike, job: str) -> Path:
    """The simulator workspace of ``job`` under ``root`` (SimEnv's layout; ``$NVFLARE_SIMULATOR_WORKSPACE_ROOT`` wins)."""
    from nvflare.recipe.sim_env import SIMULATOR_WORKSPACE_ROOT_ENV_VAR

    return Path(os.environ.get(SIMULATOR_WORKSPACE_ROOT_ENV_VAR) or root) / job


def result_path(workspace: str | os.PathLike, result_file: str) -> Path:
    """Where the server of a simulator run keeps the job's result file."""
    return Path(workspace) / "server" / "simulate_job" / "app_server" / result_file


def run_job(job: str, sites: int, *, root: str | os.PathLike = DEFAULT_ROOT, preset: str | None = None,
            assignments: Sequence[str] = (), rounds: int | None = None, seed: int | None = None, verbose: bool = False,
            out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``job`` on ``sites`` simulated sites (site-1..site-N) in FLARE's SimEnv under ``root``; ``assignments``:
    ``key=value`` overrides of the preset (:func:`medflare.presets.overrides_from_assignments`). Returns ``{"job",
    "workspace", "result", "evaluate", "errors"}``; raises MedflareError when the run failed or saved no result."""
    from medflare.common.summary import evaluate_command
    from medflare.jobs.logs import run_log_config, site_log_config, write_log_config
    from medflare.presets import overrides_from_assignments

    check_job(job)
    if sites < 1:
        raise ConfigError(f"medflare run: -n must be at least 1, got {sites}")
    overrides = overrides_from_assignments(list(assignments))
    recipe = build_recipe(job, sites, preset=preset, overrides=overrides, rounds=rounds, seed=seed)

    from nvflare.recipe import SimEnv

    workspace = workspace_of(root, job)
    log_config = write_log_config(site_log_config() if verbose else run_log_config(), workspace / "local" / "log_config.json")
    env = SimEnv(num_clients=sites, num_threads=sites, workspace_root=str(workspace.parent), log_config=str(log_config))
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # FLARE's advice for its processes
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # each round's line when it happens
    settings = ", ".join(f"{k} {v}" for k, v in (("preset", preset), ("rounds", rounds), ("seed", seed)) if v is not None)
    out(f"medflare run: job '{job}' on {sites} site{'s' if sites != 1 else ''} in FLARE's simulator (SimEnv, {sites} "
        f"thread{'s' if sites != 1 else ''})" + (f", {settings}" if settings else "") + (f", overrides {overrides}" if overrides else "")
        + f"; workspace {workspace}")
    try:
        recipe.run(env)
    except RuntimeError as e:  # SimEnv: the simulator's return code was not 0
        raise MedflareError(f"job '{job}' failed: {e}; logs: {workspace / 'server' / 'log.txt'}") from e
    result = result_path(workspace, recipe.result_file)
    errors = _error_lines(workspace / "server" / "log.txt")
    if not result.is_file():
        raise MedflareError(f"job '{job}' saved no result ({result} is missing); see the errors in {workspace / 'server' / 'log.txt'}")
    names = [f"site-{i}" for i in range(1, sites + 1)]
    command = evaluate_command(result, names)
    out(f"result: {result}")
    out(f"score it: {command}")
    out(f"logs: {workspace / 'server' / 'log.txt'} (server), {workspace / 'site-1' / 'log.txt'} (each site); "
        f"curves: tensorboard --logdir {workspace / 'server' / 'simulate_job' / 'tb_events'}")
    if errors:
        out(f"note: the server logged {errors} error line(s); see {workspace / 'server' / 'log.txt'}")
    return {"job": job, "workspace": str(workspace), "result": str(result), "evaluate": command, "errors": errors}


def _error_lines(log: Path) -> int:
    """How many ERROR lines a log file holds (0 when there is none)."""
    if not log.is_file():
        return 0
    return sum(" - ERROR - " in line for line in log.read_text(errors="replace").splitlines())
