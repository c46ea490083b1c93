"""``medflare submit <job>``: send a job to a POC or provisioned federation as an exported copy, never ``jobs/<job>``.

FLARE signs the folder it submits, in place: ``.__nvfl_sig.json`` and the submitter's certificate appear in every folder
of it. Submitting ``jobs/<job>`` itself (``nvflare job submit -j jobs/<job>``, or the Session API on it) would leave
them in the repository. So the job's recipe, with the user's settings, is exported to a temporary folder, without
``app/custom`` (which makes a job "bring your own code"; the shipped site templates refuse that and admit medflare's
classes through their ``class_allow_list`` instead: app_configs/README.md), and that copy is submitted with FLARE's
Session API, then removed. By hand: ``cp -r jobs/<job> /tmp/<job> && rm -r /tmp/<job>/app/custom && nvflare job submit
-j /tmp/<job> --startup-kit KIT``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from medflare import ConfigError, MedflareError
from medflare.jobs.run import build_recipe, check_job


def export_copy(job: str, out_dir: str | os.PathLike, *, preset: str | None = None, assignments: Sequence[str] = (),
                rounds: int | None = None, seed: int | None = None, byoc: bool = False) -> Path:
    """Export ``job``'s recipe with the given settings into ``out_dir/<job>`` (without ``app/custom`` unless ``byoc``);
    returns that folder. A FedAvg-like job keeps its folder's sites per round."""
    from medflare.jobs.export import sort_filter_tasks
    from medflare.presets import overrides_from_assignments

    overrides = overrides_from_assignments(list(assignments))
    recipe = build_recipe(check_job(job), None, preset=preset, overrides=overrides, rounds=rounds, seed=seed)
    recipe.export(str(out_dir))
    folder = Path(out_dir) / job
    sort_filter_tasks(folder)
    if not byoc:
        for custom in folder.glob("app*/custom"):
            shutil.rmtree(custom)
    return folder


def submit_job(job: str, startup_kit: str | os.PathLike, *, username: str | None = None, preset: str | None = None,
               assignments: Sequence[str] = (), rounds: int | None = None, seed: int | None = None, byoc: bool = False,
               out: Callable[[str], None] = print, session_factory: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Submit an exported copy of ``job`` with the admin kit ``startup_kit`` (user ``username``, default the kit folder's
    name); returns ``{"job", "job_id", "settings"}``. ``session_factory`` (default FLARE's ``new_secure_session``) is
    called as ``factory(username, startup_kit)``."""
    kit = Path(startup_kit)
    if not (kit / "startup").is_dir():
        raise ConfigError(f"medflare submit: '{kit}' is not an admin startup kit (no startup/ folder in it)")
    username = username or kit.name
    if session_factory is None:
        from nvflare.fuel.flare_api.flare_api import new_secure_session as session_factory
    with tempfile.TemporaryDirectory(prefix="medflare-submit-") as tmp:
        folder = export_copy(job, tmp, preset=preset, assignments=assignments, rounds=rounds, seed=seed, byoc=byoc)
        session = session_factory(username, str(kit))
        try:
            job_id = session.submit_job(str(folder))
        except Exception as e:  # FLARE's own message says why (authorization, a refused component, ...)
            raise MedflareError(f"medflare submit: FLARE refused job '{job}': {e}") from e
        finally:
            session.close()
    out(f"submitted job '{job}' (an exported copy; jobs/{job} is untouched) as {job_id}")
    out(f"watch it: nvflare job wait {job_id} --startup-kit {kit}; then: nvflare job download {job_id} -o RESULTS "
        f"--startup-kit {kit}")
    settings = {"preset": preset, "set": list(assignments), "rounds": rounds, "byoc": byoc}
    return {"job": job, "job_id": job_id, "settings": settings}
