"""A site's own settings for every job it runs: ``<site local/>/medflare_site.json``, owned by the hospital.

A job says what to train; the site says what it allows and what its machine is. Privacy parameters
(noise on statistics, DP noise multiplier, clip norm, delta, epsilon budget) and compute settings (threads,
data loader workers, device) therefore come from the site's ``local/`` folder, never from the job: a job
cannot lower a hospital's privacy protection. The file is optional; an absent section means the
algorithm's documented defaults. Layout (template: app_configs/site/local/medflare_site.json.example)::

    {"privacy": {"<key>": value, ...},          # read by the algorithms; each documents its keys
     "compute": {"threads": 4, "workers": 2},   # read by the executors
     "fediod": {"teacher": {...}, ...},         # FedIOD: the site's own teacher (medflare.fediod.teacher)
     "per_site": {"site-2": {"privacy": {...}}}} # one machine serving several sites (simulator, POC): overlays by name

Unknown sections are an error naming the file, so a typo does not silently switch a protection off.

The section names are plain data (:data:`SECTIONS`, :data:`ALGORITHM_SECTIONS`), not a registry that algorithms fill:
one site file serves every job the site runs and every job checks all of it (a FedAvg job must accept the file's
``fediod`` section), whichever algorithm the process imported. An algorithm that reads its own section adds its name
to :data:`ALGORITHM_SECTIONS`; this module imports no algorithm (docs/design.md "Layers").
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

from medflare import ConfigError

SITE_CONFIG = "medflare_site.json"
#: sections an algorithm reads itself (each documents its keys where it reads them)
ALGORITHM_SECTIONS = ("fediod",)
SECTIONS = ("privacy", "compute", *ALGORITHM_SECTIONS)


def read_site_config(local_dir: str | os.PathLike | None, site: str) -> dict[str, dict[str, Any]]:
    """``{"privacy": {...}, "compute": {...}}`` of ``site`` from ``local_dir/medflare_site.json`` (empty sections when absent)."""
    out: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    path = Path(local_dir) / SITE_CONFIG if local_dir is not None else None
    if path is None or not path.is_file():
        return out
    try:
        content = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"site '{site}': cannot read '{path}' as JSON: {exc}") from exc
    if not isinstance(content, Mapping):
        raise ConfigError(f"site '{site}': '{path}' must hold a JSON object")
    overlay = (content.get("per_site") or {}).get(site, {})
    for where, sections in ((str(path), content), (f"{path} per_site.{site}", overlay)):
        unknown = sorted(set(sections) - set(SECTIONS) - ({"per_site"} if sections is content else set()))
        if unknown:
            raise ConfigError(f"site '{site}': unknown section(s) {unknown} in '{where}' (known: {list(SECTIONS)}, per_site)")
        for name in SECTIONS:
            value = sections.get(name, {})
            if not isinstance(value, Mapping):
                raise ConfigError(f"site '{site}': section '{name}' of '{where}' must be an object, got {value!r}")
            out[name].update(copy.deepcopy(dict(value)))
    return out


def setting(config: Mapping[str, Mapping[str, Any]], section: str, key: str, default: Any, check=None, site: str = "") -> Any:
    """``config[section][key]`` or ``default``; ``check(value) -> bool`` refuses a bad value with a ConfigError naming it."""
    value = config.get(section, {}).get(key, default)
    if check is not None and not check(value):
        raise ConfigError(f"site '{site}': {SITE_CONFIG} '{section}.{key}' = {value!r} is not allowed")
    return value
