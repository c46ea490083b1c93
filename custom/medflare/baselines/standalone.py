"""Local-only and centralised training over the same site data as the FLARE jobs (comparison rows).

Local-only: each site trains its own model on its own data and is tested on its own test split (the
lower bound the paper's FedSM Table 3 reports as "local"). Centralised: one model on the union of all
sites' training data, tested on each site (the upper bound federated learning tries to reach). Both use
the same preset, loop, loss and metrics as the federated jobs, so the rows are comparable.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import ConcatDataset

from medflare import MedflareError
from medflare.common.report import site_table
from medflare.common.training import (batch_size_for, capped_batch_size, local_work, make_loader, make_loss, make_optimizer, pick_device,
                                     recompute_batchnorm, short_round, train_epochs)
from medflare.data import SiteData, load_site
from medflare.metrics import evaluate
from medflare.nets import build_from_spec
from medflare.presets import get_preset

MODES = ("local", "central")


def run_standalone(
    mode: str,
    preset: str,
    sites: Sequence[str],
    *,
    epochs: int,
    overrides: Mapping[str, Any] | None = None,
    device: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train in ``mode`` ("local" | "central") for ``epochs`` epochs; test every site.

    Returns ``site_table(...)`` of the test split plus ``curve`` (client-average validation key metric
    after each epoch), ``mode``, ``preset`` and ``seconds``.
    """
    if mode not in MODES:
        raise MedflareError(f"unknown mode '{mode}' (known: {list(MODES)})")
    if not sites:
        raise MedflareError("no sites given")
    cfg = get_preset(preset, overrides)
    dev = pick_device(device)
    data = {site: load_site(site, cfg["data"]) for site in sites}
    start = time.perf_counter()
    if mode == "central":
        model = _new_model(cfg, seed, dev)
        pooled = ConcatDataset([d.train for d in data.values()])
        curve = _fit(model, pooled, data, cfg, epochs, dev, seed, log, label="central")
        models = {site: model for site in sites}
    else:
        models, curves = {}, []
        for site, d in data.items():
            models[site] = _new_model(cfg, seed, dev)
            curves.append(_fit(models[site], d.train, {site: d}, cfg, epochs, dev, seed, log, label=f"local {site}"))
        curve = [sum(c[i] for c in curves) / len(curves) for i in range(epochs)]
    tested = {site: _evaluate(models[site], d, cfg, "test", dev) for site, d in data.items()}
    table = site_table(tested)
    table.update(mode=mode, preset=preset, curve=curve, seconds=time.perf_counter() - start)
    return table


def _new_model(cfg: Mapping, seed: int, dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_from_spec(cfg["model"]).to(dev)


def _fit(model, train_set, val_sites: Mapping[str, SiteData], cfg, epochs, dev, seed, log, label) -> list[float]:
    """Train epoch by epoch, recording the client-average validation key metric after each.

    After each epoch the BatchNorm statistics are set to the training set's (:func:`recompute_batchnorm`): the
    model is validated and tested in eval mode, and the running averages of its last batches, taken while the weights
    still moved, can undo the training. ``cls_synthetic_tiny`` centralised at Dir(0.5), 4 sites, 4 epochs: train-mode
    loss 0.24, eval-mode validation accuracy 0.23 with the running averages, 0.91 after this pass (the quick report's
    centralised rows were near chance before it)."""
    train = cfg["train"]
    task = next(iter(val_sites.values())).task
    optimizer = make_optimizer(train["optimizer"], model.parameters(), train["lr"])
    loss_fn = make_loss(train["loss"], task)
    key = cfg["eval"]["key_metric"]
    curve = []
    batch = capped_batch_size(batch_size_for(train, dev), len(train_set), train.get("max_batch_fraction", 1.0))
    for epoch in range(epochs):  # an epoch here is a federated job's round: the same local work (local_work)
        stats = train_epochs(
            model, make_loader(train_set, batch, True, seed + epoch), loss_fn, optimizer,
            **{**local_work(train), "epochs": 1}, device=dev, amp=train["amp"],
        )
        recompute_batchnorm(model, train_set, batch, dev)
        scores = [_evaluate(model, d, cfg, "val", dev)["mean"][key] for d in val_sites.values()]
        curve.append(sum(scores) / len(scores))
        log(f"{label}: epoch {epoch + 1}/{epochs}: {stats.steps} steps (batch {batch}), loss {stats.mean_loss:.4f} val {key} {curve[-1]:.4f}")
        warning = short_round(label, stats.steps, train)
        if warning:
            log(f"warning: {warning}")
    return curve


def _evaluate(model, d: SiteData, cfg, split: str, dev) -> dict[str, Any]:
    """Scores on a split: per case, or per volume for volume presets (as the federated jobs validate)."""
    if d.whole_volumes is not None:
        loader, predict = d.whole_volumes.loader(split), d.whole_volumes.predictor(model)
    else:
        loader, predict = make_loader(getattr(d, split), cfg["eval"]["batch_size"] or cfg["train"]["batch_size"], False), None
    return evaluate(model, loader, task=d.task, num_classes=d.num_classes, metrics=cfg["eval"]["metrics"], device=dev,
                    predict=predict)
