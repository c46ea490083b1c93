"""Regenerate the job folders under ``jobs/`` from the recipes, or check that they match.

    python -m medflare.jobs.export            # rewrite jobs/<name>/{meta.json,app/} from each recipe
    python -m medflare.jobs.export --check    # exit 1 and list the differences if any folder is stale

A job folder's hand-written README.md is kept; everything FLARE reads is the recipe's export.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from medflare.jobs.run import build_recipe
from medflare.recipes import RECIPES

REPO = Path(__file__).resolve().parents[3]
EXPORTED = ("meta.json", "app")


def export(name: str, out_dir: Path, seed: int | None = None) -> Path:
    """Export recipe ``name`` with its defaults (and ``seed``, see :func:`medflare.jobs.run.build_recipe`) into
    ``out_dir/<name>``; returns that folder."""
    build_recipe(name, None, seed=seed).export(str(out_dir))
    sort_filter_tasks(out_dir / name)
    return out_dir / name


def sort_filter_tasks(job: Path) -> None:
    """Sort the ``tasks`` of every filter chain in the job's configs: FLARE's job API keeps them as a set, so their
    exported order changes from one Python process to the next (string hashing) and the export would not be stable."""
    for path in job.glob("app*/config/config_fed_*.json"):
        config = json.loads(path.read_text())
        chains = [c for key in ("task_data_filters", "task_result_filters") for c in config.get(key, [])]
        if chains:
            for chain in chains:
                chain["tasks"] = sorted(chain.get("tasks", []))
            path.write_text(json.dumps(config, indent=4))


def files_of(job: Path) -> dict[str, object]:
    """``{relative path: parsed JSON or text}`` of what FLARE reads in a job folder (not its README.md)."""
    out = {}
    for top in EXPORTED:
        for path in sorted((job / top).rglob("*") if (job / top).is_dir() else [job / top]):
            if path.is_file():
                text = path.read_text()
                out[str(path.relative_to(job))] = json.loads(text) if path.suffix == ".json" else text
    return out


def differences(name: str, jobs_dir: Path) -> list[str]:
    """What differs between ``jobs_dir/<name>`` and the recipe's export (empty when they match)."""
    with tempfile.TemporaryDirectory() as tmp:
        exported, shipped = files_of(export(name, Path(tmp))), files_of(jobs_dir / name)
    diff = [f"{name}/{p}: only in the recipe's export" for p in sorted(set(exported) - set(shipped))]
    diff += [f"{name}/{p}: only in the job folder" for p in sorted(set(shipped) - set(exported))]
    diff += [f"{name}/{p}: differs" for p in sorted(set(exported) & set(shipped)) if exported[p] != shipped[p]]
    return diff


def write(name: str, jobs_dir: Path) -> None:
    """Replace what FLARE reads in ``jobs_dir/<name>`` by the recipe's export."""
    with tempfile.TemporaryDirectory() as tmp:
        src = export(name, Path(tmp))
        dst = jobs_dir / name
        dst.mkdir(parents=True, exist_ok=True)
        for top in EXPORTED:
            if (dst / top).is_dir():
                shutil.rmtree(dst / top)
            elif (dst / top).exists():
                (dst / top).unlink()
            (shutil.copytree if (src / top).is_dir() else shutil.copy)(src / top, dst / top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--jobs", type=Path, default=REPO / "jobs", help="the jobs folder (default: the repo's)")
    parser.add_argument("names", nargs="*", help="recipes to export (default: all)")
    args = parser.parse_args(argv)
    names = args.names or sorted(RECIPES)
    if args.check:
        diff = [d for n in names for d in differences(n, args.jobs)]
        print("\n".join(diff) or f"{len(names)} job folders match their recipes")
        return 1 if diff else 0
    for name in names:
        write(name, args.jobs)
        print(f"wrote {args.jobs / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
