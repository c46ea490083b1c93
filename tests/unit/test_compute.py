"""The thread rule (medflare.common.compute): each process gets its share of the cores and no more; a site's
explicit setting wins; the simulator's run arguments say how many site processes share the machine."""

from __future__ import annotations

import argparse

import pytest
import torch

from medflare import ConfigError
from medflare.common.compute import (
    CORES_ENV,
    PROCESSES_ENV,
    apply_threads,
    available_cores,
    compute_share,
    process_share,
    simulator_processes,
)


def _sim_args(threads, n_clients=None, clients=None, gpu=None):
    """What FLARE's simulator passes to each site process as FLContextKey.ARGS (its argparse namespace)."""
    return argparse.Namespace(job_folder="job", workspace="ws", n_clients=n_clients, clients=clients, threads=threads, gpu=gpu)


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(PROCESSES_ENV, raising=False)
    monkeypatch.delenv(CORES_ENV, raising=False)


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 16, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_each_of_n_processes_gets_at_least_one_and_at_most_its_share(cores, n):
    for workers in (0, 1, 3):
        share = process_share(cores, n, workers=workers)
        assert share.threads >= 1
        assert share.threads <= max(1, cores // n)
        if cores >= n:  # all processes together stay within the machine (workers included, when they fit)
            assert n * share.threads <= cores
            if workers < cores // n:
                assert n * (share.threads + workers) <= cores


def test_share_is_the_whole_share_without_workers_and_shrinks_by_them():
    assert process_share(16, 4).threads == 4
    assert process_share(16, 4, workers=1).threads == 3
    assert process_share(2, 4).threads == 1  # more processes than cores: one thread each, never zero
    assert process_share(16, 1).threads == 16


def test_an_explicit_site_setting_wins_over_the_environment_and_the_rule():
    assert process_share(16, 4, env_threads=7).threads == 7
    share = process_share(16, 4, threads=12, env_threads=7)
    assert share.threads == 12 and "compute.threads" in share.reason
    config = {"compute": {"threads": 3, "workers": 2}}
    share = compute_share(config, site="site-1", fl_args=_sim_args(4, n_clients=4), cores=16)
    assert (share.threads, share.workers) == (3, 2)


def test_simulator_args_say_how_many_sites_run_at_once():
    assert simulator_processes(_sim_args(4, n_clients=4)) == 4
    assert simulator_processes(_sim_args(1, n_clients=4)) == 1  # -t 1: one site process at a time
    assert simulator_processes(_sim_args(4, clients="site-1,site-2")) == 2  # never more than the sites
    assert simulator_processes(_sim_args(1, n_clients=4, gpu="[0],[1]")) == 2  # one client per GPU group at a time
    assert simulator_processes(_sim_args(2, n_clients=4, gpu="0")) == 2
    # a POC/production site process: FLARE's client args have no simulator threads
    assert simulator_processes(argparse.Namespace(workspace="ws", fed_client="x")) is None
    assert simulator_processes(None) is None


def test_where_the_process_count_comes_from(monkeypatch):
    sim = _sim_args(4, n_clients=4)
    share = compute_share({}, site="site-1", fl_args=sim, cores=16)
    assert (share.processes, share.threads) == (4, 4) and "simulator" in share.reason
    # POC / production: one site per machine
    share = compute_share({}, site="site-1", fl_args=argparse.Namespace(workspace="ws"), cores=16)
    assert (share.processes, share.threads) == (1, 16)
    # the server computes while the sites wait: the whole machine, also in the simulator
    assert compute_share({}, site="server", fl_args=sim, role="server", cores=16).threads == 16
    # the environment (e.g. a POC federation on one machine) beats the simulator's count ...
    monkeypatch.setenv(PROCESSES_ENV, "8")
    assert compute_share({}, site="site-1", fl_args=sim, cores=16).threads == 2
    # ... and the site's own setting beats both
    share = compute_share({"compute": {"processes": 2}}, site="site-1", fl_args=sim, cores=16)
    assert share.threads == 8 and "compute.processes" in share.reason
    # OMP_NUM_THREADS set by the user is respected (below the site's setting)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert compute_share({}, site="site-1", fl_args=sim, cores=16).threads == 1
    assert compute_share({"compute": {"threads": 5}}, site="site-1", fl_args=sim, cores=16).threads == 5


def test_workers_default_to_the_preset_and_come_out_of_the_share():
    share = compute_share({}, site="site-1", fl_args=_sim_args(2, n_clients=2), default_workers=2, cores=16)
    assert (share.threads, share.workers) == (6, 2)
    share = compute_share({"compute": {"workers": 0}}, site="site-1", fl_args=_sim_args(2, n_clients=2), default_workers=2, cores=16)
    assert (share.threads, share.workers) == (8, 0)


@pytest.mark.parametrize("section, key", [({"threads": 0}, "compute.threads"), ({"workers": -1}, "compute.workers"),
                                          ({"processes": "4"}, "compute.processes"), ({"threads": True}, "compute.threads")])
def test_bad_settings_name_the_key(section, key):
    with pytest.raises(ConfigError, match=rf"site 'site-3'.*'{key}'"):
        compute_share({"compute": section}, site="site-3", cores=4)


def test_bad_environment_is_named(monkeypatch):
    monkeypatch.setenv(PROCESSES_ENV, "lots")
    with pytest.raises(ConfigError, match=PROCESSES_ENV):
        compute_share({}, site="site-1", cores=4)


def test_a_cores_cap_shares_a_machine_between_runs_and_never_raises_the_count(monkeypatch):
    """Two simulator runs side by side on 2 cores (the test suite's background runs): each says it has 1 core, so the
    server (which otherwise takes every core) and the sites take 1 thread; a cap above the machine changes nothing."""
    sim = _sim_args(threads=3, n_clients=3)
    assert compute_share({}, site="server", role="server", cores=2).threads == 2
    monkeypatch.setenv(CORES_ENV, "1")
    server = compute_share({}, site="server", role="server", cores=2)
    assert (server.cores, server.threads) == (1, 1) and f"${CORES_ENV}=1" in server.reason
    assert compute_share({}, site="site-1", fl_args=sim, cores=2).threads == 1
    monkeypatch.setenv(CORES_ENV, "8")
    assert compute_share({}, site="server", role="server", cores=16).threads == 8
    assert compute_share({}, site="server", role="server", cores=4).cores == 4
    assert CORES_ENV not in compute_share({}, site="server", role="server", cores=4).reason
    monkeypatch.setenv(CORES_ENV, "0")
    with pytest.raises(ConfigError, match=CORES_ENV):
        compute_share({}, site="server", role="server", cores=4)


def test_available_cores_honours_a_container_quota(tmp_path):
    affinity = available_cores(tmp_path / "absent")
    assert affinity >= 1
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")  # one CPU's worth of time per period
    assert available_cores(quota) == 1
    quota.write_text("max 100000\n")
    assert available_cores(quota) == affinity


def test_apply_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert apply_threads(process_share(4, 4)) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
