"""Copy a job folder with settings changed: preset, rounds, site count, filters (the report, benchmarks, tests).

A job folder stays the one source of truth for how a job is wired; this only rewrites the values a
user would edit by hand (``preset``/``overrides`` of every medflare component, the workflow's
``num_rounds``/``num_clients``) so that the same job runs tiny in tests and large in benchmarks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from medflare import ConfigError
from medflare.common.preset_check import components  # noqa: F401 - the report and tests import it from here


def customize_job(
    src: str | Path,
    dst: str | Path,
    *,
    preset: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    workflow_args: Mapping[str, Any] | None = None,
    executor_args: Mapping[str, Any] | None = None,
    task_result_filters: list[dict] | None = None,
    task_data_filters: list[dict] | None = None,
    server_task_result_filters: list[dict] | None = None,
    server_settings: Mapping[str, Any] | None = None,
    client_settings: Mapping[str, Any] | None = None,
    server_components: list[dict] | None = None,
    persistor_args: Mapping[str, Any] | None = None,
) -> Path:
    """Copy job ``src`` to ``dst`` and set the given values in every app's configs; returns ``dst``.

    ``preset``/``overrides`` go to every medflare component that takes them (persistor and executors),
    ``workflow_args`` (e.g. num_rounds, num_clients) to every workflow, ``executor_args`` to every executor,
    ``task_result_filters`` / ``task_data_filters`` replace the client configs' result / task data filters and ``server_task_result_filters`` the
    server's (``[]`` removes the server's update guard, e.g. for a control run); ``server_settings`` /
    ``client_settings`` set top-level keys of the server / client config (e.g. ``{"server":
    {"task_request_interval": 0.1}}`` or ``{"default_task_fetch_interval": 0.1}``); ``server_components``
    (``{"id", "path", "args"}`` dicts) are appended to the server's components (e.g. a test widget);
    ``persistor_args`` update the args of the server component with id ``persistor`` (e.g.
    ``source_ckpt_file_full_name`` to resume from a saved model).
    """
    src, dst = Path(src), Path(dst)
    if not (src / "meta.json").is_file():
        raise ConfigError(f"'{src}' is not a FLARE job folder (no meta.json)")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for path in dst.glob("*/config/config_fed_*.json"):
        config = json.loads(path.read_text())
        for comp in components(config, filters=True):  # the sites' manifest check sizes its bounds from the preset
            args = comp.setdefault("args", {})
            if comp.get("path", "").startswith("medflare.") and "preset" in args:
                if preset is not None:
                    args["preset"] = preset
                if overrides is not None:
                    args["overrides"] = dict(overrides)
        for wf in config.get("workflows", []):
            wf.setdefault("args", {}).update(workflow_args or {})
        for entry in config.get("executors", []):
            entry["executor"].setdefault("args", {}).update(executor_args or {})
        is_client = path.name == "config_fed_client.json"
        if task_result_filters is not None and is_client:
            config["task_result_filters"] = task_result_filters
        if task_data_filters is not None and is_client:
            config["task_data_filters"] = task_data_filters
        if server_task_result_filters is not None and not is_client:
            config["task_result_filters"] = server_task_result_filters
        config.update((client_settings if is_client else server_settings) or {})
        if server_components and not is_client:
            config.setdefault("components", []).extend(server_components)
        if persistor_args and not is_client:
            persistor = next((c for c in components(config) if c.get("id") == "persistor"), None)
            if persistor is None:
                raise ConfigError(f"'{src}': persistor_args given but the server config has no component 'persistor'")
            persistor.setdefault("args", {}).update(persistor_args)
        path.write_text(json.dumps(config, indent=2))
    return dst
