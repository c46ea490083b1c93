"""POC tests. ``pocfed`` is provisioning/pocfed.py (a script, not a package), loaded once for all of them."""

import contextlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path


def _load_pocfed():
    spec = importlib.util.spec_from_file_location("pocfed", Path(__file__).resolve().parents[2] / "provisioning" / "pocfed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pocfed"] = module
    spec.loader.exec_module(module)
    return module


pocfed = _load_pocfed()


@contextlib.contextmanager
def poc_federation(tmp_path_factory, preset: str, n_sites: int, **kwargs):
    """A started POC federation of ``n_sites`` hospitals for one test module, data of ``preset`` written by `medflare
    data`, HOME isolated (the Session API in this process touches nothing under the user's ~); on exit stopped, and
    no process of it may be left (killed, not `nvflare poc stop`ped: 30 s saved per module). Attributes added:
    ``data``, ``jobs_dir``, ``results``. ``kwargs`` go to PocFederation."""
    from medflare.cli import main as medflare_main

    stale = pocfed.kill_stale_test_federations()  # of earlier runs killed before their teardown
    if stale:
        print(f"killed processes of stale POC federations: {stale}")
    root = tmp_path_factory.mktemp("poc")
    federation = pocfed.PocFederation(root / "fed", n_sites=n_sites, data_dir=root / "data", owner_pid=os.getpid(), **kwargs)
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = str(federation.home)
    try:
        federation.prepare()
        assert medflare_main(["data", "--preset", preset, "--sites", ",".join(federation.sites), "--out", str(root / "data")]) == 0
        federation.start(timeout=180)
        federation.data = root / "data"
        federation.jobs_dir = root / "jobs"
        federation.results = root / "results"
        yield federation
    finally:
        federation.stop(graceful=False)  # SIGTERM, then SIGKILL: nothing of a test federation is kept
        if old_home is not None:
            os.environ["HOME"] = old_home
        leftovers = federation.pids()
        assert not leftovers, f"POC processes left running: {leftovers}"


def poc_job(fed, src: str, name: str, preset: str, *, keep_custom: bool = False, meta: dict | None = None, **customize) -> Path:
    """A copy of jobs/<src> for the federation ``fed`` (``customize_job`` with ``preset`` and ``customize``), named
    ``name``, without app/custom (so every medflare class passes the sites' allow-list) unless ``keep_custom``, with
    ``meta`` merged into its meta.json."""
    from medflare.jobs.customize import customize_job

    job = customize_job(Path(__file__).resolve().parents[2] / "jobs" / src, fed.jobs_dir / name, preset=preset, **customize)
    if not keep_custom:
        shutil.rmtree(job / "app" / "custom", ignore_errors=True)
    data = json.loads((job / "meta.json").read_text())
    data.update(name=name, **(meta or {}))
    (job / "meta.json").write_text(json.dumps(data, indent=2))
    return job
