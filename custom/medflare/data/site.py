"""Where a site's data comes from, and loading it: the same rules in simulator, POC and production.

Resolution order (:func:`resolve_site_source`):
  1. ``$MEDFLARE_DATA``, a folder holding ``<site>.json`` (segmentation datalist) or ``<site>.npz``
     (classification). When set, it must hold the site's file: a set variable is never ignored.
  2. ``<local_dir>/medflare_data.json``, the FLARE site's own config, holding one of
     ``{"datalist": path}``, ``{"npz": path}`` or ``{"data_dir": folder}`` (then ``<folder>/<site>.json|.npz``);
     relative paths are relative to ``local_dir``.
  3. For ``synthetic_seg`` / ``synthetic_cls``: the embedded default, generated on first use into
     ``$MEDFLARE_CACHE`` (or ``~/.cache/medflare``) in a folder named by its parameters.
     For ``datalist`` / ``npz``: an error saying how to point the site at its data.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from medflare import ConfigError, DataError, MedflareError
from medflare.data.loaders import NPZ_SPLITS, SEG_SPLITS, load_npz_split, load_seg_split
from medflare.data.synthetic_cls import make_cls_sites
from medflare.data.synthetic_seg import make_seg_site
from medflare.data.util import DATA_ENV, cache_root, ensure_generated, param_tag

#: data kind -> task
KINDS = {"synthetic_seg": "segmentation", "datalist": "segmentation", "synthetic_cls": "classification", "npz": "classification"}
_SUFFIX = {"segmentation": ".json", "classification": ".npz"}
#: task -> the medflare_data.json key naming a file of that task's data
_CONFIG_KEY = {"segmentation": "datalist", "classification": "npz"}
LOCAL_CONFIG = "medflare_data.json"
_GENERATOR_VERSION = 1  # bump when a generator's output changes, so stale caches are not reused


@dataclass
class SiteData:
    """A site's train/val/test datasets and what a model needs to know about them.

    ``source`` is the datalist JSON or .npz actually used; ``num_classes`` includes background for
    segmentation; ``in_channels`` is the image channel count C of items shaped (C, H, W).
    """

    site: str
    task: str
    source: pathlib.Path
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    num_classes: int
    in_channels: int


def _task(data_cfg: Mapping) -> str:
    kind = data_cfg.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"unknown data kind '{kind}' in config key 'data.kind' (known: {sorted(KINDS)})")
    return KINDS[kind]


def _check_suffix(path: pathlib.Path, task: str, site: str, where: str) -> pathlib.Path:
    if path.suffix != _SUFFIX[task]:
        raise DataError(f"site '{site}': {where} gives '{path}', but {task} data must be a {_SUFFIX[task]} file")
    if not path.is_file():
        raise DataError(f"site '{site}': {where} gives '{path}', which does not exist")
    return path


def _from_data_dir(folder: pathlib.Path, site: str, task: str, where: str) -> pathlib.Path:
    """``<folder>/<site>.json|.npz`` for the task, or an error naming the folder and the site."""
    if not folder.is_dir():
        raise DataError(f"site '{site}': {where} = '{folder}' is not a folder")
    wanted = folder / f"{site}{_SUFFIX[task]}"
    if wanted.is_file():
        return wanted
    other = [p.name for p in (folder / f"{site}{s}" for s in _SUFFIX.values()) if p.is_file()]
    hint = f" (it has {other[0]}, which is not {task} data)" if other else ""
    raise DataError(f"site '{site}': {where} = '{folder}' holds no {wanted.name}{hint}")


def _from_local_config(config: pathlib.Path, site: str, task: str) -> pathlib.Path:
    """The data path named by a site's ``local/medflare_data.json``."""
    try:
        content = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"site '{site}': cannot read '{config}' as JSON: {exc}") from exc
    keys = sorted(set(content) & {"datalist", "npz", "data_dir"}) if isinstance(content, dict) else []
    if len(keys) != 1 or len(content) != 1:
        raise DataError(
            f"site '{site}': '{config}' must hold exactly one of the keys 'datalist', 'npz', 'data_dir'; got {content!r}"
        )
    key = keys[0]
    path = pathlib.Path(content[key]).expanduser()
    path = path if path.is_absolute() else config.parent / path
    where = f"'{config}' key '{key}'"
    if key == "data_dir":
        return _from_data_dir(path, site, task, where)
    expected = _CONFIG_KEY[task]
    if key != expected:
        raise DataError(f"site '{site}': {where} names {key} data, but the job needs {task} ('{expected}')")
    return _check_suffix(path, task, site, where)


def _synthetic_source(site: str, data_cfg: Mapping) -> pathlib.Path:
    """Generate (once, atomically) and return the embedded default data of ``site``."""
    kind = data_cfg["kind"]
    if kind == "synthetic_seg":
        params = dict(
            image_size=int(data_cfg.get("image_size", 64)),
            num_classes=int(data_cfg.get("num_classes", 3)),
            seed=int(data_cfg.get("seed", 0)),
            scale=float(data_cfg.get("scale", 1.0)),
        )
        folder = cache_root() / f"seg_{param_tag(v=_GENERATOR_VERSION, **params)}" / site
        ensure_generated(folder, f"{site}.json", lambda tmp: make_seg_site(site, tmp, **params))
        return folder / f"{site}.json"
    params = dict(
        num_sites=int(data_cfg.get("num_sites", 10)),
        beta=float(data_cfg.get("beta", 0.1)),
        image_size=int(data_cfg.get("image_size", 28)),
        channels=int(data_cfg.get("channels", 1)),
        num_classes=int(data_cfg.get("num_classes", 10)),
        style_shift=bool(data_cfg.get("style_shift", True)),
        seed=int(data_cfg.get("seed", 0)),
        scale=float(data_cfg.get("scale", 1.0)),
    )
    folder = cache_root() / f"cls_{param_tag(v=_GENERATOR_VERSION, **params)}"
    ensure_generated(folder, "site-1.npz", lambda tmp: make_cls_sites(tmp, **params))
    path = folder / f"{site}.npz"
    if not path.is_file():
        raise DataError(
            f"site '{site}': synthetic_cls data has sites site-1..site-{params['num_sites']} "
            f"(config key 'data.num_sites'); name the FLARE sites so, or set {DATA_ENV}"
        )
    return path


def resolve_site_source(site: str, data_cfg: Mapping, local_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The datalist JSON or .npz that ``site`` uses (see the module docstring for the order of rules).

    Generates the embedded synthetic default when the kind is synthetic and nothing is configured.
    """
    task = _task(data_cfg)
    env = os.environ.get(DATA_ENV)
    if env:
        return _from_data_dir(pathlib.Path(env).expanduser(), site, task, f"${DATA_ENV}")
    if local_dir is not None and (pathlib.Path(local_dir) / LOCAL_CONFIG).is_file():
        return _from_local_config(pathlib.Path(local_dir) / LOCAL_CONFIG, site, task)
    if data_cfg["kind"].startswith("synthetic_"):
        return _synthetic_source(site, data_cfg)
    raise DataError(
        f"site '{site}': data kind '{data_cfg['kind']}' needs the site's own data; set ${DATA_ENV} to a folder "
        f"holding {site}{_SUFFIX[task]}, or write <local>/{LOCAL_CONFIG} "
        f"(e.g. {{\"{_CONFIG_KEY[task]}\": \"/path/to/{site}{_SUFFIX[task]}\"}})"
    )


def load_site(
    site: str, data_cfg: Mapping[str, Any], local_dir: str | os.PathLike | None = None, cache: bool = True
) -> SiteData:
    """Resolve and load ``site``'s train/val/test datasets (checked now; with ``cache``, loaded now too).

    ``data_cfg`` is a preset's ``data`` section; ``local_dir`` the FLARE site's ``local/`` folder.
    """
    task = _task(data_cfg)
    source = resolve_site_source(site, data_cfg, local_dir)
    try:
        if task == "segmentation":
            if "num_classes" not in data_cfg and data_cfg["kind"] == "datalist":
                raise ConfigError("config key 'data.num_classes' is required for kind 'datalist'")
            num_classes = int(data_cfg.get("num_classes", 3))
            splits = [load_seg_split(source, s, num_classes=num_classes, cache=cache) for s in SEG_SPLITS]
            in_channels = int(splits[0][0]["image"].shape[0])
        else:
            num_classes = data_cfg.get("num_classes")
            splits = [load_npz_split(source, s, num_classes=num_classes) for s in NPZ_SPLITS]
            if num_classes is None:
                num_classes = int(max(int(d.labels.max()) for d in splits)) + 1
            in_channels = int(splits[0].images.shape[1])
        expected = data_cfg.get("channels")
        if expected is not None and int(expected) != in_channels:
            raise DataError(f"'{source}' has {in_channels}-channel images but config key 'data.channels' is {expected}")
    except MedflareError as exc:
        named = exc.for_site(site)
        if named is exc:
            raise
        raise named from exc
    return SiteData(site, task, source, *splits, num_classes=int(num_classes), in_channels=in_channels)
