"""A site that sends NaN updates from round 1 on does not end the job or poison the model: the server's update guard.

The site is made broken by a client result filter (:class:`medflare.testing.poison.PoisonFilter`), the way the issue
measured it. With the job as shipped, the job finishes on the other sites, the saved model is finite, and the server
log and TensorBoard name the site; FedSM (a :class:`~medflare.common.workflow.SiteRounds` workflow) goes on with
``min_responses=2`` after refusing a 1000x update. The control (the same poison without the guard gives a NaN model)
is tests/unit/test_update_guard.py::test_poisoned_site_makes_fedavg_nan_unless_the_guard_refuses_it, on FLARE's own
FedAvg aggregation helper, which keeps this file at two simulator runs; measured end to end it is the same: without
the server filter the 3-site FedAvg job ends with a NaN ``FL_global_model.pt`` (jobs/fedavg/README.md).
"""

import numpy as np
import pytest
import torch

from medflare.common.results import read_checkpoint
from medflare.fedsm.persistor import SUPER_MODEL_FILE
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

CLIENTS = ["site-1", "site-3", "site-4"]
BAD = "site-3"
ROUNDS = 3


def poison_filters(scale=None):
    return [{"tasks": ["train"], "filters": [{"path": "medflare.testing.poison.PoisonFilter",
                                              "args": {"site": BAD, "from_round": 1, "scale": scale}}]}]


def nonfinite(checkpoint):
    """Names of the float tensors in a saved checkpoint (nested dicts) that hold NaN/Inf."""
    bad = []

    def walk(tree, path):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(tree, torch.Tensor) and tree.is_floating_point() and not torch.isfinite(tree).all():
            bad.append(path)
        elif isinstance(tree, np.ndarray) and np.issubdtype(tree.dtype, np.floating) and not np.isfinite(tree).all():
            bad.append(path)

    walk(checkpoint, "")
    return bad


def _run(repo, tmp_path, job, name, rounds, guard=True, workflow_args=None, scale=None):
    folder = customize_job(repo / "jobs" / job, tmp_path / name, preset="seg_synthetic_tiny",
                           workflow_args={"num_rounds": rounds, **(workflow_args or {})},
                           executor_args={"overlay_every": 100}, task_result_filters=poison_filters(scale),
                           server_task_result_filters=None if guard else [])
    return run_simulator(folder, tmp_path / f"ws_{name}", len(CLIENTS), clients=CLIENTS, timeout=300)


#: every run of the module, started in the background (tests/e2e/__init__.py)
RUNS = {
    "fedavg_run": lambda repo, tmp: _run(repo, tmp, "fedavg", "fedavg", ROUNDS, workflow_args={"num_clients": len(CLIENTS)}),
    "fedsm_run": lambda repo, tmp: _run(repo, tmp, "fedsm", "fedsm", 2, workflow_args={"min_responses": 2}, scale=1000.0),
}
fedavg_run, fedsm_run = simulation("fedavg_run"), simulation("fedsm_run")


def test_fedavg_guard_refuses_the_nan_site_and_the_job_goes_on(fedavg_run):
    run = fedavg_run
    assert run.returncode == 0, run.log[-4000:]
    for rnd in range(1, ROUNDS):
        assert f"update guard refused the 'train' result of site '{BAD}' in round {rnd}: NaN/Inf values in " in run.log, run.log[-4000:]
    assert f"site '{BAD}' in round 0" not in run.log  # round 0 was clean
    model = read_checkpoint(run.app_server / "FL_global_model.pt")
    assert not nonfinite(model)
    scalars = run.scalars()
    # round 3 trains nothing: the sites score the final model (the poison acts on 'train' results only)
    assert dict(scalars["simulator_server"][f"guard/refused/{BAD}"]) == {0: 0.0, 1: 1.0, 2: 1.0, 3: 0.0}
    assert dict(scalars["simulator_server"]["guard/refused/site-1"]) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    for site in CLIENTS:  # every site, the broken one too, got a finite model each round and validated it
        dice = dict(scalars[site]["val_global/dice"])
        assert sorted(dice) == list(range(ROUNDS + 1)) and all(np.isfinite(v) for v in dice.values()), (site, dice)
    good = [s for s in CLIENTS if s != BAD]
    assert all(dict(scalars[s]["val_global/dice"])[ROUNDS - 1] > dict(scalars[s]["val_global/dice"])[0] for s in good), scalars


def test_fedsm_guard_refuses_an_outsized_update_and_goes_on_with_the_others(fedsm_run):
    """SiteRounds: a site whose update is 1000x its size is refused by the norm rule and counts as missing."""
    run = fedsm_run
    assert run.returncode == 0, run.log[-4000:]
    assert f"update guard refused the 'train' result of site '{BAD}' in round 1: weights: update norm" in run.log, run.log[-4000:]
    assert f"round 1 task 'train': going on with ['site-1', 'site-4']; the server's update guard refused ['{BAD}']" in run.log
    assert f"site '{BAD}' in round 0" not in run.log  # round 0 was clean
    assert (run.app_server / SUPER_MODEL_FILE).is_file(), run.log[-4000:]
    assert not nonfinite(read_checkpoint(run.app_server / SUPER_MODEL_FILE))
    assert dict(run.scalars()["simulator_server"][f"guard/refused/{BAD}"])[1] == 1.0
