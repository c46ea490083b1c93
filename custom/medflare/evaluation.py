"""Score a saved result on a datalist, an .npz or sites' data: ``medflare evaluate`` as a function.

:func:`evaluate_result` returns what ``medflare evaluate --out`` writes (per site, per case, client average and
global, for each predictor the result's kind offers); the CLI and the report both call it, so a report row is
scored exactly as a user scores a file. :func:`open_result` and :func:`kind_options` are the steps ``show``,
``predict`` and ``sample`` share with it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

from medflare import ConfigError


def open_result(model: str | os.PathLike, preset: str | None = None, device: str = "auto"):
    """``(result, device)``: the saved result at ``model`` on the device ``device`` names (``auto``: the first GPU when
    present); ``preset`` for a plain state dict that does not describe itself."""
    from medflare.common.results import load_result
    from medflare.common.training import pick_device

    result = load_result(model, preset=preset)
    dev = pick_device(device)
    return result.to(dev), dev


def kind_options(result, raw: Mapping[str, str | None], model: str | os.PathLike = "") -> dict[str, Any]:
    """The parsed values of ``raw`` (``{option name: text or None}``), each an option of the result's kind; a value
    given for another kind's option is a ConfigError naming both kinds."""
    from medflare.common.options import declared_options
    from medflare.common.results import kind

    own = {o.name: o for o in kind(result.kind).options}
    owners: dict[str, str] = {}
    for name, declared in declared_options().items():
        for o in declared.options:
            owners.setdefault(o.name, name)
    values = {}
    for name, text in raw.items():
        if text is None:
            continue
        if name not in own:
            raise ConfigError(f"--{name} is an option of kind '{owners.get(name, '?')}'; '{model}' is kind '{result.kind}'")
        values[name] = own[name].parse(text)
    return values


def _split_prefix(split: str) -> str:
    """"train" / "val" / "test" for any spelling of a split (the data layer's one table of split names)."""
    from medflare.data.datalists import split_keys

    return split_keys(split)[1]


def sources(data_cfg: Mapping[str, Any], split: str, *, datalist: str | None = None, npz: str | None = None,
            sites: Sequence[str] | None = None) -> dict[str, tuple]:
    """``{name: (dataset, task, num_classes)}``: one datalist, one .npz, or sites (their configured or embedded data).

    For volume presets the "dataset" is the split's datalist entries (scored per volume on the stored grid).
    """
    from medflare.data import load_npz_split, load_seg_split, load_site
    from medflare.data.site import resolve_site_source
    from medflare.data.writeback import is_volume_preset, volume_entries

    if not (datalist or npz or sites):
        raise ConfigError("evaluate: give a datalist, an .npz or site names")
    num_classes = data_cfg["num_classes"]
    if is_volume_preset(data_cfg):
        lists = {datalist: datalist} if datalist else {name: resolve_site_source(name, data_cfg) for name in sites}
        return {name: (volume_entries(path, split, data_cfg), "segmentation", num_classes) for name, path in lists.items()}
    if datalist:
        return {datalist: (load_seg_split(datalist, split, num_classes=num_classes), "segmentation", num_classes)}
    if npz:
        return {npz: (load_npz_split(npz, _split_prefix(split), num_classes=num_classes), "classification", num_classes)}
    out = {}
    for name in sites:
        site = load_site(name, data_cfg)
        out[name] = (getattr(site, _split_prefix(split)), site.task, site.num_classes)
    return out


def made_up_site_notes(data_cfg: Mapping[str, Any], sites: Sequence[str] | None, trained: Sequence[str] | None) -> list[str]:
    """One note per site whose synthetic data would be made up on the spot (no MEDFLARE_DATA, a synthetic preset) for a
    site that is not one of the result's training sites (``trained``, when the file names them) or not one of the
    embedded synthetic sites (site-1..site-6 of the segmentation style table), so that a typo is never scored silently."""
    from medflare.data.util import DATA_ENV

    if not sites or os.environ.get(DATA_ENV) or data_cfg.get("kind") != "synthetic_seg":
        return []  # synthetic_cls refuses a site beyond data.num_sites itself
    from medflare.data.synthetic_seg import STYLE_TABLE, segmentation_style

    notes = []
    for site in sites:
        if trained and site not in trained:
            why = f"it is not one of the result's training sites ({', '.join(trained)})"
        elif segmentation_style(site, int(data_cfg.get("seed", 0)))["jitter"] > 0:
            why = f"it is not one of the embedded synthetic sites site-1..site-{len(STYLE_TABLE)} (a jittered variant of their styles)"
        else:
            continue
        notes.append(f"note: site '{site}' has no data here (${DATA_ENV} is not set): scoring synthetic data made up for it; {why}")
    return notes


def _evaluate_one(label, predictor, sources, metrics, device, batch_size, verbose, data_cfg, log) -> dict[str, Any]:
    """Score one predictor on every source and ``log`` the summary a person reads."""
    import torch

    from medflare.common.report import confusion_matrix, confusion_table, metrics_table, per_class_table, site_table
    from medflare.common.training import make_loader
    from medflare.data.writeback import is_volume_preset, scored_batches
    from medflare.metrics import evaluate
    from medflare.metrics.site_mean import unseen_classes_warning

    per_site, reports = {}, {}
    for name, (dataset, task, num_classes) in sources.items():
        if hasattr(predictor, "reset"):
            predictor.reset()
        model = predictor if isinstance(predictor, torch.nn.Module) else None
        if is_volume_preset(data_cfg):  # per volume: predicted whole, mapped back to the stored grid, scored in mm
            if model is not None:
                model.eval()
            result = evaluate(None, scored_batches(predictor, dataset, data_cfg, num_classes, device), task=task,
                              num_classes=num_classes, metrics=metrics, device=device, predict=lambda labels: labels)
        else:
            result = evaluate(model, make_loader(dataset, batch_size, False), task=task, num_classes=num_classes,
                              metrics=metrics, device=device, predict=None if model is not None else predictor)
        if hasattr(predictor, "report"):
            result["report"] = reports[name] = predictor.report()
        if task == "classification":
            result["confusion"] = confusion_matrix(result["per_case"], num_classes)
        per_site[name] = result
    table = site_table(per_site)
    log(f"\n== {label} ==")
    for name, (_, task, num_classes) in sources.items():
        warning = unseen_classes_warning(name, num_classes, per_site[name].get("unseen_classes", []), per_site[name]["num_cases"])
        if warning:
            log(warning)
    log(metrics_table(table, counts={n: r["num_cases"] for n, r in per_site.items()}))
    if any(len(classes) > 1 or r.get("unseen_classes") for r in per_site.values() for classes in r.get("per_class", {}).values()):
        log("\nper class ('-': in no label at that site, left out of the class mean):\n"
            + per_class_table(per_site))
    for name, result in per_site.items():
        if "confusion" in result:
            log(f"\n{name}: confusion matrix and per-class accuracy (%)\n" + confusion_table(result["confusion"]))
        if verbose:
            log(f"\n{name}: per case")
            for case in result["per_case"]:
                log("  " + "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in case.items()))
    return {"label": label, "sites": per_site, "client_average": table["client_average"], "global": table["global"]}


def evaluate_result(model: str | os.PathLike, *, datalist: str | None = None, npz: str | None = None,
                    sites: Sequence[str] | None = None, split: str = "testing", metrics: Sequence[str] | None = None,
                    batch_size: int = 8, verbose: bool = False, preset: str | None = None, device: str = "auto",
                    options: Mapping[str, str | None] | None = None,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Score the saved result ``model`` on ``datalist``, ``npz`` or ``sites`` (split ``split``) with ``metrics`` (default:
    the preset's); ``options`` are the kind's options as text (``{"gamma": "0.9"}``). Returns ``{"model", "kind",
    "split", "options", "evaluations": [{"label", "sites", "client_average", "global"}, ...]}``, one evaluation per
    predictor the kind offers, then one per model the kind is compared with (a super model's global model; the key
    metric of every model is then also printed side by side); the tables a person reads go to ``log``."""
    result, dev = open_result(model, preset, device)
    parsed = kind_options(result, options or {}, model)
    data_cfg = result.description["data"]
    for note in made_up_site_notes(data_cfg, sites, result.description.get("sites")):
        log(note)
    found = sources(data_cfg, split, datalist=datalist, npz=npz, sites=sites)
    chosen = list(metrics) if metrics else result.preset["eval"]["metrics"]
    log(f"{model}: kind '{result.kind}', preset '{result.description['preset']}', {split} split, device {dev}")
    from medflare.common.report import named_fractions_table

    titles: dict[str, str] = {}  # label -> what its routing report is (a predictor that routes cases, e.g. FedSM's)

    def scored(label: str, predictor) -> dict[str, Any]:
        evaluation = _evaluate_one(label, predictor, found, chosen, dev, batch_size, verbose, data_cfg, log)
        if any("report" in r for r in evaluation["sites"].values()):
            titles[label] = getattr(predictor, "report_title", "share of each test site's cases routed to each model (%)")
        return evaluation

    own = [scored(label, predictor) for label, predictor in result.predictors(parsed)]
    beside = [scored(label, predictor) for label, predictor in result.compared_with()]
    evaluations = own + beside  # the result's own predictors first: a report row reads evaluations[0]
    if beside:
        key = result.preset["eval"]["key_metric"]
        log(f"\n== side by side: {key} (%) of each model ==\n" + side_by_side_table(beside + own, key))
    for e in evaluations:
        if e["label"] in titles:
            routed = {site: r["report"] for site, r in e["sites"].items() if "report" in r}
            log(f"\n{e['label']}: {titles[e['label']]}\n" + named_fractions_table(routed, first="test site"))
    return {"model": str(model), "kind": result.kind, "split": split, "options": parsed, "evaluations": evaluations}


def side_by_side_table(evaluations: Sequence[Mapping[str, Any]], key: str) -> str:
    """One markdown row per test site (then the client average and all cases pooled), one column per evaluated model:
    its ``key`` score in percent."""
    from medflare.common.report import POOLED, format_cell, metric_header

    first = evaluations[0]
    rows = [(site, [e["sites"][site]["mean"].get(key) for e in evaluations], str(first["sites"][site]["num_cases"]))
            for site in first["sites"]]
    if len(rows) > 1:
        rows += [("client average", [e["client_average"].get(key) for e in evaluations], ""),
                 (POOLED, [e["global"].get(key) for e in evaluations], "")]
    lines = ["| test site | cases | " + " | ".join(f"{e['label']}: {metric_header(key)}" for e in evaluations) + " |",
             "|" + "---|" * (len(evaluations) + 2)]
    lines += [f"| {name} | {cases} | " + " | ".join(format_cell(key, v) for v in values) + " |" for name, values, cases in rows]
    return "\n".join(lines)
