"""Issue 31, small hospitals: FedAvg's job at its default local work learns on sites of 40-150 training images.

One simulator run of the FedAvg job on three small synthetic classification sites (Dirichlet(0.5) label skew, 4 classes,
57-106 training images; the sites of benchmarks/small_sites.py) at ``cls_synthetic``'s training settings (batch 64,
one epoch a round). Before issue 31 each site took 1-2 steps a round and the global model stayed near the
majority-class rate; with the preset's step floor and batch cap it learns.
"""

import pytest
import torch

from medflare.common.results import load_result
from medflare.data import load_site
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation
from medflare.presets import get_preset

pytestmark = pytest.mark.slow

ROUNDS = 4
CLIENTS = ["site-1", "site-2", "site-3"]  # 106, 60 and 57 training images
#: cls_synthetic as six small sites (the job runs three of them) with cls_synthetic_tiny's narrower ConvNet; training at
#: the preset's defaults
SMALL = {"data": {"num_sites": 6, "beta": 0.5, "num_classes": 4, "scale": 0.15},
         "model": {"args": {"in_channels": 1, "num_classes": 4, "image_size": 28, "width": 32}}}


def _small(repo, tmp_path):
    folder = customize_job(repo / "jobs" / "fedavg", tmp_path / "job", preset="cls_synthetic", overrides=SMALL,
                           workflow_args={"num_rounds": ROUNDS, "num_clients": len(CLIENTS)})
    return run_simulator(folder, tmp_path / "ws", len(CLIENTS), clients=CLIENTS, timeout=600)


RUNS = {"small_run": _small}  # started in the background (tests/e2e/__init__.py)
small_run = simulation("small_run")


def test_fedavg_default_learns_on_small_sites_and_puts_its_steps_on_the_record(small_run):
    run = small_run
    assert run.returncode == 0, run.log[-4000:]
    assert "EXECUTION_EXCEPTION" not in run.log, run.log[-4000:]

    # the final global model on every case no site trained on (all six sites' validation and test splits, all four
    # classes): above the majority-class rate by a margin, and not one class for everything
    cfg = get_preset("cls_synthetic", SMALL)
    net = next(iter(load_result(run.app_server / "FL_global_model.pt").networks.values()))
    images, labels = [], []
    for k in range(1, 7):
        data = load_site(f"site-{k}", cfg["data"])
        for split in (data.val, data.test):
            for case in split:
                images.append(case["image"])
                labels.append(int(case["label"].reshape(-1)[0]))
    x, y = torch.stack(images), torch.tensor(labels)
    with torch.no_grad():
        pred = net(x).argmax(1)
    accuracy = float((pred == y).float().mean())
    majority = float(torch.bincount(y).max()) / len(y)
    print(f"balanced-ish test accuracy {accuracy:.3f}, majority-class rate {majority:.3f}")
    assert accuracy > majority + 0.2 and pred.unique().numel() >= 3, (accuracy, majority, torch.bincount(pred))

    # every site's steps per round on the record, at least the floor, and no short-round warning
    for site, series in run.site_scalars().items():
        steps = dict(series["train/steps"])
        assert sorted(steps) == list(range(ROUNDS)) and min(steps.values()) >= cfg["train"]["min_steps"] > 2, f"{site}: {steps}"
    assert "local steps" in run.log and "fewer than train.warn_steps" not in run.log
    assert run.egress_violations() == []
