"""A POC federation of this bundle on loopback: hospitals from project.yml, our site templates installed.

Used by tests/poc and by hand (provisioning/README.md):

    python provisioning/pocfed.py up   --root /tmp/medflare-poc [-n 2] [--data DIR]
    python provisioning/pocfed.py down --root /tmp/medflare-poc
    python provisioning/pocfed.py install-templates --kit KIT_DIR --role site|server [--data DIR]

Everything lives under ``root``: ``root/home`` (HOME of every nvflare command, so ~/.nvflare of the user
is never touched), ``root/ws`` (POC workspace: startup kits, the server's job store and snapshots) and
``root/project.yml`` (provisioning/project.yml cut to n hospitals, on free loopback ports). ``down``
runs ``nvflare poc stop`` and then kills, by pid, every process whose command line or working
directory lies under ``root`` (FLARE starts job processes in their own sessions, so stopping the
parents is not enough after a failed run). ``kill(name)`` ends one participant the hard way (SIGKILL of
its parent and job processes, a crash or power cut) and ``start_participant(name)`` starts it again: what
tests/poc/test_poc_reliability.py does to a hospital and to the server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PROJECT = REPO / "provisioning" / "project.yml"
TEMPLATES = REPO / "app_configs"


def free_port() -> int:
    """A TCP port that is free on loopback now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poc_project(n_sites: int = 2, fed_port: int | None = None, admin_port: int | None = None, src: Path = PROJECT) -> dict:
    """provisioning/project.yml with its first ``n_sites`` hospitals, their admins, and the server on the given ports."""
    project = yaml.safe_load(Path(src).read_text())
    parts = project["participants"]
    server = next(p for p in parts if p["type"] == "server")
    clients = [dict(p) for p in parts if p["type"] == "client"][:n_sites]
    if len(clients) < n_sites:
        raise ValueError(f"{src} has {len(clients)} client sites, {n_sites} asked for")
    for c in clients:
        c.pop("capacity", None)  # POC sites get the template's resources.json (no GPUs claimed)
    orgs = {c["org"] for c in clients}
    admins = [p for p in parts if p["type"] == "admin" and (p["role"] == "project_admin" or p["org"] in orgs)]
    server = {**server, "fed_learn_port": fed_port or free_port(), "admin_port": admin_port or free_port()}
    project["participants"] = [server, *clients, *admins]
    return project


def install_templates(kit: str | Path, role: str, data_dir: str | Path | None = None, storage_root: str | Path | None = None) -> list[Path]:
    """Copy app_configs/<role>/local/* into a startup kit's local/ (what a hospital's operator does by hand).

    ``role`` is "site" or "server"; ``data_dir`` (site) writes local/medflare_data.json pointing at it;
    ``storage_root`` (server) moves the job store and snapshot storage of resources.json under it.
    """
    if role not in ("site", "server"):
        raise ValueError(f"role must be 'site' or 'server', got {role!r}")
    local = Path(kit) / "local"
    local.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted((TEMPLATES / role / "local").iterdir()):
        if src.suffix == ".example":
            continue
        dst = local / src.name
        shutil.copy(src, dst)
        written.append(dst)
    if role == "site" and data_dir is not None:
        dst = local / "medflare_data.json"
        dst.write_text(json.dumps({"data_dir": str(Path(data_dir).resolve())}))
        written.append(dst)
    if role == "server" and storage_root is not None:
        set_server_storage(local / "resources.json", local / "resources.json", storage_root)
    return written


def set_server_storage(src: str | Path, dst: str | Path, storage_root: str | Path) -> None:
    """Write server resources ``src`` to ``dst`` with its job store and snapshot storage under ``storage_root``."""
    res = json.loads(Path(src).read_text())
    root = Path(storage_root).resolve()
    res["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(root / "snapshot-storage")
    for comp in res["components"]:
        if comp["id"] == "job_manager":
            comp["args"]["uri_root"] = str(root / "jobs-storage")
    Path(dst).write_text(json.dumps(res, indent=2))


def set_heart_beat_timeout(resources: str | Path, seconds: float) -> None:
    """Set ``servers[0].heart_beat_timeout`` (seconds of a site's silence before the server drops it) in a server's resources.json."""
    res = json.loads(Path(resources).read_text())
    res["servers"][0]["heart_beat_timeout"] = seconds
    Path(resources).write_text(json.dumps(res, indent=2))


class PocFederation:
    """One POC federation under ``root`` (see the module docstring). Use as a context manager: always stopped."""

    def __init__(
        self, root: str | Path, n_sites: int = 2, data_dir: str | Path | None = None, templates: bool = True, owner_pid: int | None = None,
        heart_beat_timeout: float | None = None,
    ):
        """``owner_pid``: the process whose death makes this federation stale (tests pass their own pid);
        ``heart_beat_timeout``: seconds of silence after which the server drops a site (default: the server
        template's, see provisioning/README.md §10; tests that kill a site pass less)."""
        self.root = Path(root).resolve()
        self.heart_beat_timeout = heart_beat_timeout
        self.owner_pid = owner_pid
        self.n_sites = n_sites
        self.data_dir = data_dir
        self.templates = templates
        self.home = self.root / "home"
        self.ws = self.root / "ws"
        self.project_file = self.root / "project.yml"
        self.project: dict | None = None
        bindir = str(Path(sys.executable).parent)  # start.sh runs `python3`: ours, with medflare installed
        self.env = {
            **os.environ,
            "HOME": str(self.home),
            "NVFLARE_POC_WORKSPACE": str(self.ws),
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "MALLOC_ARENA_MAX": "2",
            "PYTHONUNBUFFERED": "1",
            # every hospital of the federation computes on this one machine: each process takes its share of the cores
            # (medflare.common.compute), not all of them as on a hospital's own machine (unless the caller says otherwise)
            "MEDFLARE_PROCESSES": os.environ.get("MEDFLARE_PROCESSES") or str(n_sites),
        }

    # ---- participants ------------------------------------------------------------------------
    def _project(self) -> dict:
        """The cut project.yml: written by prepare(), read back by a later command (``down``)."""
        if self.project is None:
            self.project = yaml.safe_load(self.project_file.read_text())
        return self.project

    def _names(self, kind: str, role: str | None = None) -> list[str]:
        parts = self._project()["participants"]
        return [p["name"] for p in parts if p["type"] == kind and (role is None or p.get("role") == role)]

    @property
    def sites(self) -> list[str]:
        return self._names("client")

    @property
    def server(self) -> str:
        return self._names("server")[0]

    @property
    def admin(self) -> str:
        return self._names("admin", "project_admin")[0]

    @property
    def prod(self) -> Path:
        return self.ws / self._project()["name"] / "prod_00"

    def kit(self, name: str) -> Path:
        return self.prod / name

    # ---- life cycle --------------------------------------------------------------------------
    def _nvflare(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "nvflare.cli", *args]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def prepare(self) -> None:
        """Provision the POC kits (nvflare poc prepare -i) and install our templates into local/."""
        self.kill_leftovers()
        if self.root.exists():
            shutil.rmtree(self.root)
        self.home.mkdir(parents=True)
        if self.owner_pid is not None:
            (self.root / "owner.pid").write_text(str(self.owner_pid))
        self.project = poc_project(self.n_sites)
        self.project_file.write_text(yaml.safe_dump(self.project, sort_keys=False))
        self._nvflare("poc", "prepare", "-i", str(self.project_file), "--force", timeout=180)
        if self.templates:
            install_templates(self.kit(self.server), "server", storage_root=self.root / "storage")
            if self.heart_beat_timeout is not None:
                set_heart_beat_timeout(self.kit(self.server) / "local" / "resources.json", self.heart_beat_timeout)
            for site in self.sites:
                install_templates(self.kit(site), "site", data_dir=self.data_dir)
        else:  # still keep the job store out of /tmp/nvflare, shared by every POC on the machine
            local = self.kit(self.server) / "local"
            set_server_storage(local / "resources.json.default", local / "resources.json", self.root / "storage")

    def start(self, timeout: float = 180) -> None:
        """nvflare poc start (server and clients), then wait until every site is connected."""
        # --no-wait: FLARE's own readiness check logs in with a 1 s connection timeout, which a loaded machine
        # misses until its deadline; wait_connected() waits with the Session API instead
        self._nvflare("poc", "start", "--no-wait", timeout=120)
        self.wait_connected(self.sites, timeout)

    def start_participant(self, name: str, timeout: float = 180, wait_for: list[str] | None = None) -> None:
        """Start one participant again (``nvflare poc start -p``), e.g. after kill(), and wait until the sites
        ``wait_for`` are connected: by default the site itself, or for the server every site ([] = until the
        server answers the admin)."""
        self._nvflare("poc", "start", "-p", name, "--no-wait", timeout=120)
        self.wait_connected(wait_for if wait_for is not None else self.sites if name == self.server else [name], timeout)

    def wait_connected(self, sites: list[str], timeout: float = 180) -> None:
        """Wait until the server answers the admin and lists every one of ``sites`` as connected."""
        deadline = time.time() + timeout
        connected: set[str] = set()
        while True:
            try:
                sess = self.session(timeout=min(20.0, max(5.0, deadline - time.time())))  # a fresh login per try
                try:
                    while True:
                        connected = {c.name for c in sess.get_connected_client_list()}
                        if set(sites) <= connected:
                            return
                        if time.time() > deadline:
                            break
                        time.sleep(1)
                finally:
                    sess.close()
            except Exception:  # noqa: BLE001 - the server is not up yet: try again until the deadline
                if time.time() > deadline:
                    raise
                time.sleep(1)
            if time.time() > deadline:
                raise TimeoutError(f"sites {sorted(set(sites) - connected)} not connected after {timeout:.0f} s")

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of participant ``name`` (its parent process and its job processes), as a crash
        or a power cut would end them; returns their pids. Nothing of it is told first."""
        pids = self.pids(self.kit(name))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.time() + 10
        while any(Path(f"/proc/{p}").exists() and not _is_zombie(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        return pids

    def session(self, user: str | None = None, timeout: float = 60):
        """A FLARE Session API session as ``user`` (default: the project admin), retried until ``timeout`` s.

        One login attempt can give up after FLARE's short connect timeout while a just-restarted server is
        still opening its admin port on a loaded machine (seen as ``NoConnection`` in a CI run): a
        connection refused before the deadline is tried again, anything else is raised at once.
        """
        from nvflare.fuel.flare_api.api_spec import NoConnection
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        user = user or self.admin
        deadline = time.time() + timeout
        while True:
            try:
                return new_secure_session(user, str(self.kit(user)), timeout=max(5.0, deadline - time.time()))
            except NoConnection:
                if time.time() + 2 > deadline:
                    raise
                time.sleep(2)

    def stop(self, timeout: float = 60, graceful: bool = True) -> None:
        """nvflare poc stop (unless not ``graceful``: a throw-away test federation, whose orderly shutdown costs
        about 30 s), then kill whatever is left of this federation; never raises."""
        if graceful and self.project_file.exists() and self.ws.exists():
            try:
                self._nvflare("poc", "stop", timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                pass
        self.kill_leftovers()

    def clean(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def up(self) -> "PocFederation":
        """prepare() and start(); stopped again if either fails."""
        try:
            self.prepare()
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> "PocFederation":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- processes ---------------------------------------------------------------------------
    def pids(self, under: str | Path | None = None) -> list[int]:
        """Processes whose command line or working directory lies under ``under`` (default: root)."""
        mark = str(Path(under).resolve() if under else self.root)
        found = []
        for pid, cmd in processes():
            if pid == os.getpid():
                continue
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if mark in cmd or cwd == mark or cwd.startswith(mark + os.sep):
                found.append(pid)
        return found

    def kill_leftovers(self, grace: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``grace`` s, every process of this federation (by pid)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.time() + grace
            while pids and time.time() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
                time.sleep(0.2)
            if not pids:
                return


def cmdline(pid: int) -> str | None:
    """The command line of process ``pid``, arguments joined by spaces; None if it is gone or unreadable."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def processes():
    """(pid, command line) of every process that can be read now."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmd = cmdline(int(entry.name))
            if cmd is not None:
                yield int(entry.name), cmd


_FED_ROOT = re.compile(r"(/\S*?/poc\d*/fed)/ws/")


def kill_stale_test_federations() -> list[str]:
    """Kill federations left by earlier test runs whose pytest process is gone; returns their roots.

    A test federation lives under ``.../poc<N>/fed`` and records its owner's pid in ``fed/owner.pid``; one
    whose owner is dead (or whose folder pytest has already deleted) can only be a leftover of a run that
    was killed before its teardown. Federations of live test runs are left alone.
    """
    roots = {m.group(1) for _, cmd in processes() if (m := _FED_ROOT.search(cmd))}
    stale = []
    for root in sorted(roots):
        owner_file = Path(root) / "owner.pid"
        if Path(root).exists() and not owner_file.exists():
            continue  # a federation started by hand (pocfed.py up): not ours to judge
        try:
            owner = int(owner_file.read_text())
            alive = Path(f"/proc/{owner}").exists() and not _is_zombie(owner)
        except (OSError, ValueError):
            alive = False  # its folder was deleted (pytest keeps the last 3 runs)
        if not alive:
            PocFederation(root).kill_leftovers()
            stale.append(root)
    return stale


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="prepare and start a POC federation of n hospitals with our site templates")
    up.add_argument("--root", required=True)
    up.add_argument("-n", type=int, default=2)
    up.add_argument("--data", help="folder of <site>.json datalists (medflare data --out); default: embedded synthetic data")
    down = sub.add_parser("down", help="stop it and kill its leftover processes")
    down.add_argument("--root", required=True)
    down.add_argument("--clean", action="store_true", help="also delete root")
    inst = sub.add_parser("install-templates", help="copy app_configs/<role>/local/* into a startup kit's local/")
    inst.add_argument("--kit", required=True)
    inst.add_argument("--role", required=True, choices=["site", "server"])
    inst.add_argument("--data", help="(site) data folder written to local/medflare_data.json")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        fed = PocFederation(args.root, n_sites=args.n, data_dir=args.data).up()
        print(f"POC federation up: server {fed.server}, sites {', '.join(fed.sites)}")
        print(f"admin kit: {fed.kit(fed.admin)}   (user {fed.admin})")
        print(f"console:   HOME={fed.home} {fed.kit(fed.admin)}/startup/fl_admin.sh")
    elif args.cmd == "down":
        fed = PocFederation(args.root)
        fed.stop()
        if args.clean:
            fed.clean()
    else:
        for path in install_templates(args.kit, args.role, data_dir=args.data):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
