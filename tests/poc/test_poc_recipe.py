"""A recipe on FLARE 2.9's PocEnv: the same FedAvgRecipe object that runs on SimEnv provisions, starts and uses a
real POC federation (server, 2 sites, admin via the Session API) and the job finishes with a global model.

PocEnv manages its own POC workspace, so the run happens in a subprocess with HOME and NVFLARE_POC_WORKSPACE in a
temporary folder (nothing under the user's ~ or /tmp/nvflare) and always stops the federation it started.
"""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.poc, pytest.mark.timeout(900)]

SCRIPT = r"""
import sys
from pathlib import Path
from medflare.common.results import load_result
from medflare.recipes import FedAvgRecipe
from nvflare.recipe import PocEnv

# FLARE waits 3 s after starting the services and logs in with a 10 s timeout; a loaded CI machine needs longer
env = PocEnv(num_clients=2, extra={"login_timeout": 180})
try:
    run = FedAvgRecipe(preset="seg_synthetic_tiny", num_rounds=2, num_clients=2).execute(env)
    result = run.get_result(timeout=600, clean_up=False)  # waits for the job, downloads its result folder
    status = run.get_status()
    print("STATUS", status)
    print("RESULT", result)
    models = sorted(Path(result).rglob("FL_global_model.pt")) if result else []
    loaded = load_result(models[0])
    print("MODEL", loaded.kind, loaded.description["preset"])
    sys.exit(0 if status == "FINISHED:COMPLETED" else 1)
finally:
    env.stop(clean_up=True)
"""


def test_fedavg_recipe_runs_on_poc_env(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NVFLARE_POC_WORKSPACE": str(tmp_path / "poc"),
           "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1",
           "MEDFLARE_PROCESSES": "2"}  # both sites compute on this machine: each takes half the cores (provisioning/pocfed.py)
    (tmp_path / "home").mkdir()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "STATUS FINISHED:COMPLETED" in out and "MODEL model seg_synthetic_tiny" in out, out[-4000:]
    assert not (tmp_path / "poc").exists() or not any((tmp_path / "poc").iterdir()), "PocEnv left its workspace"
