"""One preset per job: every medflare component of a job names the same ``preset``, ``overrides`` and ``seed``.

The server's workflow and persistor and every site's executors and manifest filter each resolve the job's preset
themselves (a FLARE component is built from its own JSON arguments), so a job folder repeats the three values in each
of them (five times in jobs/fedst_join). FLARE 2.9's config variables cannot hold them once for both sides: a variable
lives in one config file and only a top-level scalar becomes one (``nvflare.fuel.utils.wfconf``), and ``overrides`` is a
dict. So the repetition is checked instead: :class:`PresetCheck`, a component of every medflare job on the server and
at every site, reads the app's config files at START_RUN (FLARE deploys the whole app, both files, to each participant)
and ends the run with an error naming the component that differs, before any task is sent. Without it a site whose
``overrides`` were edited would quietly train another network or loss than the server expects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext

from medflare import ConfigError

#: the app config files a check reads, server first (its workflow is the reference)
CONFIG_FILES = ("config_fed_server.json", "config_fed_client.json")
#: the arguments that must agree, with the value a component that leaves one out stands for
SHARED_ARGS: dict[str, Any] = {"preset": None, "overrides": {}, "seed": None}


def components(config: Mapping[str, Any], filters: bool = False) -> Iterable[dict]:
    """Every component of a FLARE app config: workflows, components and executors (``{"path", "args"}`` dicts), and
    with ``filters`` the task data / result filters too."""
    for section in ("workflows", "components"):
        yield from config.get(section, [])
    for entry in config.get("executors", []):
        yield entry["executor"]
    if filters:
        for section in ("task_data_filters", "task_result_filters"):
            for entry in config.get(section, []):
                yield from entry.get("filters", [])


def preset_differences(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Lines naming each medflare component whose ``preset`` / ``overrides`` / ``seed`` differ from the first one's.

    ``configs``: ``{file name: parsed app config}``; a component takes part when its path starts with ``medflare.`` and
    its args hold ``preset`` (``seed`` is compared among the components that take one).
    """
    first: dict[str, tuple[str, Any]] = {}  # argument -> (who set it first, value)
    out = []
    for file, config in configs.items():
        for comp in components(config, filters=True):
            args = comp.get("args") or {}
            if not str(comp.get("path", "")).startswith("medflare.") or "preset" not in args:
                continue
            who = f"'{comp.get('id') or comp['path'].rsplit('.', 1)[-1]}' ({comp['path']}, {file})"
            for key, default in SHARED_ARGS.items():
                if key not in args and default is None:
                    continue
                value = default if args.get(key) is None else args[key]
                if key not in first:
                    first[key] = (who, value)
                elif value != first[key][1]:
                    out.append(f"component {who} has {key} {json.dumps(value)} where {first[key][0]} has "
                               f"{json.dumps(first[key][1])}")
    return out


def check_app_folder(config_dir: str | Path) -> None:
    """ConfigError naming the components of the app in ``config_dir`` whose preset, overrides or seed differ."""
    folder = Path(config_dir)
    configs = {name: json.loads((folder / name).read_text()) for name in CONFIG_FILES if (folder / name).is_file()}
    diff = preset_differences(configs)
    if diff:
        raise ConfigError("the job's components disagree on the preset they resolve (every component of a job must name "
                          "the same preset, overrides and seed; edit them together): " + "; ".join(diff))


class PresetCheck(FLComponent):
    """At START_RUN, ends the run when the job's components name different presets, overrides or seeds
    (:func:`check_app_folder` on this participant's copy of the app). No arguments."""

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.START_RUN:
            return
        workspace = fl_ctx.get_engine().get_workspace()
        try:
            check_app_folder(workspace.get_app_config_dir(fl_ctx.get_job_id()))
        except ConfigError as e:
            self.log_error(fl_ctx, str(e))
            self.system_panic(f"cannot start: {e}", fl_ctx)
