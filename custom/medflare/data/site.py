"""Where a site's data comes from, and loading it: the same rules in simulator, POC and production.

Resolution order (:func:`resolve_site_source`):
  1. ``$MEDFLARE_DATA``, a folder holding ``<site>.json`` (segmentation datalist) or ``<site>.npz``
     (classification). When set, it must hold the site's file: a set variable is never ignored.
  2. ``<local_dir>/medflare_data.json``, the FLARE site's own config, holding one of
     ``{"datalist": path}``, ``{"npz": path}`` or ``{"data_dir": folder}`` (then ``<folder>/<site>.json|.npz``);
     relative paths are relative to ``local_dir``.
  3. For ``synthetic_seg`` / ``synthetic_cls``: the embedded default, generated on first use into
     ``$MEDFLARE_CACHE`` (or ``~/.cache/medflare``) in a folder named by its parameters.
     For ``datalist`` / ``volumes`` / ``npz``: an error saying how to point the site at its data.

What a job may name on a site: nothing outside the site's own places. The data location is the site's
(``$MEDFLARE_DATA``, ``local/medflare_data.json``, the cache of generated defaults); a job only picks a preset
and overrides. Every job config value that is a path (a key named ``dir``, ``path``, ``file`` or ending
``_dir``, ``_path``, ``_file``; today ``data.cache.dir``, where the disk cache writes preprocessed images) must,
after ``~``, ``..`` and symlinks are resolved, lie inside the site's FLARE workspace or its cache folder
(``$MEDFLARE_CACHE``); a relative one is taken inside the cache folder. Anything else is a ConfigError
naming the key, raised before any file is touched (:func:`confine_job_paths`). A site's own datalist is
not a job's: it may name files anywhere (:func:`medflare.data.datalists.read_datalist`).

Kinds: ``datalist`` (2D images: NIfTI, PNG, JPEG, any size and channel count the preset accepts),
``volumes`` (3D NIfTI volumes trained as 2D slices or 3D patches, :mod:`medflare.data.volumes`), ``npz``
(MedMNIST classification) and the synthetic defaults. A datalist may be an MSD ``dataset.json`` as
published: splits it lacks are carved out of ``training`` (``data.val_fraction``, ``data.test_fraction``,
seeded by ``data.seed``; :func:`medflare.data.datalists.site_splits`).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from medflare import ConfigError, DataError, MedflareError
from medflare.data.datalists import read_datalist, site_splits
from medflare.data.loaders import (
    NPZ_SPLITS, SEG_SPLITS, cache_setting, load_npz_split, seg_image_dataset, settings_tag,
)
from medflare.data.limits import Limits
from medflare.data.synthetic_cls import make_cls_sites
from medflare.data.synthetic_seg import make_seg_site
from medflare.data.transforms import CheckSize
from medflare.data.util import DATA_ENV, cache_root, ensure_generated, param_tag, stable_seed
from medflare.data.volumes import WholeVolumes, volume_datasets

#: data kind -> task
KINDS = {"synthetic_seg": "segmentation", "datalist": "segmentation", "volumes": "segmentation",
         "synthetic_cls": "classification", "npz": "classification"}
#: kinds that read a site's own datalist and need ``data.num_classes``
_OWN_SEG = ("datalist", "volumes")
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
    ``spatial_dims`` is that of the training items (3 for patch-trained volume presets); ``whole_volumes``,
    set for volume presets, scores models per volume (validate and evaluate use it instead of the items).
    """

    site: str
    task: str
    source: pathlib.Path
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    num_classes: int
    in_channels: int
    spatial_dims: int = 2
    whole_volumes: WholeVolumes | None = None


#: a config key whose value names a place on the site's disk is called so (see the module docstring)
_PATH_NAMES = ("dir", "path", "file")
_PATH_SUFFIXES = ("_dir", "_path", "_file")


def _is_path_key(key: str) -> bool:
    return key in _PATH_NAMES or key.endswith(_PATH_SUFFIXES)


def job_path_roots(workspace_root: str | os.PathLike | None) -> list[pathlib.Path]:
    """The folders a job's paths may point into on this site: its FLARE workspace and its cache folder."""
    roots = [cache_root()]
    if workspace_root is not None:
        roots.append(pathlib.Path(workspace_root))
    return [r.expanduser().resolve() for r in roots]


def confine_job_paths(cfg: Mapping[str, Any], roots: list[pathlib.Path], site: str = "") -> dict[str, Any]:
    """``cfg`` (a preset merged with a job's overrides) with every path-valued key resolved and checked.

    Each value of a path key (see the module docstring) becomes an absolute path with ``~``, ``..`` and
    symlinks resolved (a relative one inside ``roots[0]``, the cache folder); one outside every folder of
    ``roots`` (:func:`job_path_roots`), or not a string, is a ConfigError naming the key. The loaders then
    use exactly the path that was checked.
    """
    who = f"site '{site}': " if site else ""

    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, Mapping):
            return {k: check(f"{prefix}{k}", v) if _is_path_key(str(k)) else walk(v, f"{prefix}{k}.") for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{prefix}{i}.") for i, v in enumerate(node)]
        return node

    def check(key: str, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise ConfigError(f"{who}config key '{key}' must be a path, got {value!r:.80}")
        path = pathlib.Path(value).expanduser()
        resolved = (path if path.is_absolute() else roots[0] / path).resolve()
        if not any(resolved == root or root in resolved.parents for root in roots):
            raise ConfigError(f"{who}config key '{key}' = {value!r} resolves to '{resolved}', outside this site's workspace "
                              f"and cache folder ({', '.join(str(r) for r in roots)}); a job may not read or write there")
        return str(resolved)

    return walk(cfg, "")


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
    side = int(data_cfg.get("image_size", 64 if kind == "synthetic_seg" else 28))
    Limits.from_config(data_cfg).check_size([side, side], "data.image_size")  # before generating anything
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
    whole, dims = None, 2
    try:
        if task == "segmentation":
            kind = data_cfg["kind"]
            if "num_classes" not in data_cfg and kind in _OWN_SEG:
                raise ConfigError(f"config key 'data.num_classes' is required for kind '{kind}'")
            num_classes = int(data_cfg.get("num_classes", 3))
            splits, whole = _segmentation_splits(site, source, data_cfg, num_classes, cache)
            dims = 3 if splits[0][0]["image"].ndim == 4 else 2
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
    return SiteData(site, task, source, *splits, num_classes=int(num_classes), in_channels=in_channels,
                    spatial_dims=dims, whole_volumes=whole)


def _segmentation_splits(site: str, source: pathlib.Path, data_cfg: Mapping[str, Any], num_classes: int,
                         cache: bool) -> tuple[list, WholeVolumes | None]:
    """Train/val/test datasets of a segmentation site (and per-volume scoring for volume presets)."""
    kind = data_cfg["kind"]
    if kind == "synthetic_seg":  # generated at the model's size and complete: no preprocessing settings apply
        entries = {s: read_datalist(source, s) for s in SEG_SPLITS}
        prep: Mapping[str, Any] = {}
    else:
        entries = site_splits(source, val_fraction=float(data_cfg.get("val_fraction", 0.2)),
                              test_fraction=float(data_cfg.get("test_fraction", 0.2)), seed=int(data_cfg.get("seed", 0)))
        prep = data_cfg
    store = cache_setting(prep) if cache else {"mode": "none", "rate": 0.0, "dir": None}
    tag = settings_tag(prep, num_classes)
    if kind == "volumes":
        splits, whole, _ = volume_datasets(entries, data_cfg, num_classes=num_classes, site=site, cache=store, tag=tag)
        return splits, whole
    seed = stable_seed("augment", site, int(data_cfg.get("seed", 0)))
    size_check = CheckSize()  # one size for the whole site (images used as stored)
    if kind == "synthetic_seg":
        side = int(data_cfg.get("image_size", 64))
        size_check = CheckSize([side, side], f"the preset's images are {side} x {side} (config key 'data.image_size'; "
                                             "data of a synthetic kind are used as stored)")
    return [seg_image_dataset(entries[s], prep, num_classes=num_classes, cache=store, train=s == "training", seed=seed,
                              check=cache, size_check=size_check) for s in SEG_SPLITS], None



