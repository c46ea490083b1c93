"""Small hospitals (issue 31): FedAvg, FedProx, SCAFFOLD, FedVCK and FedIOD on 6 small sites, at their defaults and
with the baselines at the optimisation-step budget of FedVCK and of FedIOD.

    python benchmarks/small_sites_methods.py --settings default           # the five methods + FedAvg centralised
    python benchmarks/small_sites_methods.py --settings matched           # the baselines at FedVCK's / FedIOD's steps
    python benchmarks/small_sites_methods.py --write-only                 # the table from what has run

The sites of benchmarks/small_sites.py (``cls_synthetic`` as 6 sites of 57-152 training images, 4 classes,
Dirichlet(0.5)); every network a ConvNet of width 32 (FedVCK's and FedIOD's default width); 10 rounds; scored on the
same balanced test set of fresh images no site holds. Each method runs the package's own code:

- FedAvg / FedProx / SCAFFOLD in one process, as their job's sites do (:class:`medflare.baselines.executor.
  SupervisedExecutor`): a model and SGD optimiser per site kept across rounds, ``train_epochs`` with ``local_work``,
  FLARE's FedProx loss (mu 0.01, the job's) or SCAFFOLD helper (:mod:`medflare.baselines.corrections`), and the
  server's mean weighted by training-set size (FLARE's FedAvg / Scaffold; SCAFFOLD's controls likewise);
- FedVCK as its shipped job in the FLARE simulator (:func:`medflare.report.runner.run_row`, the report's runner), its
  steps read from the run's TensorBoard like the report's column (:mod:`medflare.report.compute`);
- FedIOD in one process through the same site and server code its job runs (``LocalFederation``, as
  benchmarks/fediod_benchmark.py; its simulator run costs over half an hour on this shared 2-core machine).

Steps per round = optimisation steps a round spends, every site's summed plus the server's (FedVCK: the sites'
condensation steps + the server's 100 model steps; FedIOD: generator + student steps at the server, its sites'
discriminator steps and the teachers' stage-1 training not counted, as in the report). "matched": a baseline runs
exactly that many steps per round, split evenly over the 6 sites (``train.min_steps`` = ``train.max_steps``,
:func:`medflare.report.compute.steps_per_site`). Seconds: CPU seconds of the run (in-process rows:
the CPU seconds of the process (one thread); FedVCK: the CPU seconds of the simulator and its site processes,
FLARE's start-up and messaging included), so the shared machine's load does not inflate them; wall seconds are
kept in results.json.
Results are kept in ``--work``/results.json, so the two settings can run in separate calls; the markdown goes into
benchmarks/RESULTS_small_sites.md below the step-floor table of small_sites.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from small_sites import SITES, balanced_test, central, small_site_preset  # benchmarks/ is the script's folder

from medflare.baselines.corrections import ScaffoldState, fedprox_term
from medflare.common.aggregation import weighted_mean
from medflare.common.payload import load_numpy_state, state_to_numpy
from medflare.common.training import capped_batch_size, local_work, make_loader, make_loss, make_optimizer, train_epochs
from medflare.data import load_site
from medflare.nets.factory import build_from_spec
from medflare.presets import get_preset
from medflare.report.compute import budget, steps_per_site

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS_small_sites.md"
MARKER = "<!-- benchmarks/small_sites_methods.py writes below this line -->"
BASELINES = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD"}
FEDPROX_MU = 0.01  # jobs/fedprox
PRESETS = {"fedavg": "cls_synthetic", "fedprox": "cls_synthetic", "scaffold": "cls_synthetic", "fedvck": "fedvck_synthetic",
           "fediod": "fediod_cls"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", flush=True)


def settings_for(method: str, classes: int) -> dict[str, Any]:
    """Overrides that put ``method``'s own preset on the small sites: their data block, its model at 4 classes and
    width 32 (the width FedVCK's and FedIOD's presets already use)."""
    base = small_site_preset(classes)
    args = {**get_preset(PRESETS[method])["model"]["args"], "num_classes": classes, "width": 32}
    return {"data": base["data"], "model": {"args": args}}


def scores(model_fn, test: tuple[torch.Tensor, torch.Tensor], classes: int) -> dict[str, float]:
    """Balanced accuracy (mean recall over classes) and how many classes ``model_fn(images) -> logits`` predicts."""
    x, y = test
    with torch.no_grad():
        pred = model_fn(x).argmax(1)
    recall = [float((pred[y == c] == c).float().mean()) for c in range(classes)]
    return {"balanced_accuracy": float(np.mean(recall)), "classes": int(pred.unique().numel())}


def run_baseline(method: str, cfg: dict, data: dict, rounds: int, test, classes: int, steps: int | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """FedAvg / FedProx / SCAFFOLD in one process as the job's sites and server do it; ``steps``: exactly that many
    per site and round (matched compute), else the preset's local work."""
    torch.manual_seed(seed)
    train = dict(cfg["train"], **({"min_steps": steps, "max_steps": steps} if steps else {}))
    global_model = build_from_spec(cfg["model"])
    global_w = state_to_numpy(global_model)
    sites = {}
    for s, d in data.items():  # the executor's state: model, optimiser (momentum) and SCAFFOLD controls persist
        model = build_from_spec(cfg["model"])
        sites[s] = {"model": model, "opt": make_optimizer(train["optimizer"], model.parameters(), train["lr"]),
                    "batch": capped_batch_size(train["batch_size"], len(d.train), train["max_batch_fraction"]),
                    "scaffold": ScaffoldState(model) if method == "scaffold" else None}
    loss_fn = make_loss(train["loss"], "classification")
    controls = {k: np.zeros_like(v) for k, v in global_w.items()}  # FLARE's Scaffold starts c at 0 for every key
    per_round, tic, cpu = [], time.perf_counter(), time.process_time()
    for rnd in range(rounds):
        updates, deltas, weights, round_steps = [], [], [], 0
        for s, d in data.items():
            st, model = sites[s], sites[s]["model"]
            load_numpy_state(model, global_w)
            extra = fedprox_term(model, FEDPROX_MU) if method == "fedprox" else None
            after = st["scaffold"].begin_round(model, controls, train["lr"]) if st["scaffold"] else None
            stats = train_epochs(model, make_loader(d.train, st["batch"], True, seed=seed + rnd), loss_fn, st["opt"],
                                 **local_work(train), extra_loss=extra, after_step=after)
            round_steps += stats.steps
            if st["scaffold"]:
                deltas.append(st["scaffold"].end_round(model))
            updates.append(state_to_numpy(model))
            weights.append(len(d.train))
        global_w = weighted_mean(updates, weights)
        if deltas:
            for k, v in weighted_mean(deltas, weights).items():
                controls[k] = controls[k] + v
        per_round.append(round_steps)
    seconds, wall = time.process_time() - cpu, time.perf_counter() - tic
    load_numpy_state(global_model, global_w)
    global_model.eval()
    return {**scores(global_model, test, classes), "steps_per_round": float(np.mean(per_round)), "seconds": seconds,
            "wall_s": wall, "steps_per_site": steps}


def run_fedvck(work: Path, rounds: int, test, classes: int) -> dict[str, Any]:
    """The shipped FedVCK job in the simulator (the report's runner), scored on the balanced test set."""
    from medflare.evaluation import open_result
    from medflare.report.methods import METHODS
    from medflare.report.runner import Row, run_row

    row = Row(METHODS["fedvck"], tuple(SITES), rounds, mode="full", settings=settings_for("fedvck", classes))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = run_row(row, work / "report", rerun=True, log=log)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the simulator and its site processes, once they ended
    result, _ = open_result(Path(record["workspace"]) / "server" / "simulate_job" / "app_server" / METHODS["fedvck"].result,
                            device="cpu")
    (_, predict), *_ = result.predictors({})
    c = record["compute"]
    return {**scores(predict, test, classes), "steps_per_round": float(budget(record)),
            "site_steps_per_round": c["site_steps_per_round"], "server_steps_per_round": c["server_steps_per_round"],
            "seconds": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "task_s": (c["site_s"] or 0.0) + (c["server_s"] or 0.0), "wall_s": record["seconds"]}


def run_fediod(rounds: int, test, classes: int, seed: int = 0) -> dict[str, Any]:
    """FedIOD's stage 1 (a teacher per site) and stage 2 (``rounds`` rounds of distillation) in one process through
    the job's own site and server code (benchmarks/fediod_benchmark.py's :class:`Federation`)."""
    from fediod_benchmark import Federation

    from medflare.fediod.config import FedIODConfig

    class OnTheBalancedSet(Federation):
        def score(self, model, split: str = "test") -> dict[str, float]:
            if split != "test":
                return super().score(model, split)
            return scores(model, test, classes)

    overrides = settings_for("fediod", classes)
    cpu, tic = time.process_time(), time.perf_counter()
    fed = OnTheBalancedSet(PRESETS["fediod"], overrides, list(SITES), torch.device("cpu"), seed=seed)
    out = fed.distill(rounds)
    fcfg = FedIODConfig.from_preset(get_preset(PRESETS["fediod"], overrides))
    generator_steps = out["steps"] / out["rounds"]  # the controller's train/steps_generator, student_steps each
    return {**out["test"], "steps_per_round": generator_steps * (1 + fcfg.student_steps),
            "seconds": time.process_time() - cpu, "wall_s": time.perf_counter() - tic, "teacher_wall_s": fed.teacher_seconds}


def markdown(results: dict[str, Any], args) -> str:
    sizes = results.get("sizes", {})
    rows = ["| method | setting | balanced accuracy | classes predicted | steps / round (sites + server) | steps / site / round | seconds |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    order = [("fedavg", "default"), ("fedprox", "default"), ("scaffold", "default"), ("fedvck", "default"), ("fediod", "default"),
             *[(b, f"matched {ref}") for ref in ("fedvck", "fediod") for b in BASELINES]]
    names = {**BASELINES, "fedvck": "FedVCK", "fediod": "FedIOD"}
    for method, setting in order:
        r = results["runs"].get(f"{method}/{setting}")
        if r is None:
            rows.append(f"| {names[method]} | {setting} | not run | | | | |")
            continue
        total = r["steps_per_round"]
        split = (f" ({r['site_steps_per_round']:.0f} + {r['server_steps_per_round']:.0f})" if "site_steps_per_round" in r
                 else " (server)" if method == "fediod" else "")
        per_site = r.get("steps_per_site") or ("-" if method in ("fedvck", "fediod") else "25 (floor)")
        label = setting if setting == "default" else f"matched to {names[setting.split()[1]]}"
        rows.append(f"| {names[method]} | {label} | {r['balanced_accuracy']:.3f} | {r['classes']}/{args.classes} | "
                    f"{total:.0f}{split} | {per_site} | {r['seconds']:.1f} |")
    central_line = ("not run" if "central" not in results else
                    f"{results['central']['balanced_accuracy']:.3f} ({results['central']['classes']}/{args.classes} classes; "
                    f"{results['central']['seconds']:.1f} s)")
    return "\n".join([
        MARKER, "",
        "## Five methods on the small sites: at their defaults and at matched compute",
        "",
        f"`python benchmarks/small_sites_methods.py --settings default` then `--settings matched` (rounds {args.rounds}; "
        f"one seed): the sites above (training images per site {sorted(sizes.values())}, Dirichlet(0.5), {args.classes} "
        f"classes), every network a ConvNet of width 32, balanced test set of {args.test_per_class * args.classes} fresh "
        f"images (chance {1 / args.classes:.2f}). Baselines and FedIOD in one process through the package's code, "
        "FedVCK as its job in the FLARE simulator (see the script's docstring). Steps / round: optimisation steps a "
        "round spends, every site's summed + the server's; \"matched\": the baseline runs exactly the named method's "
        "steps per round, split evenly over the 6 sites. Seconds: CPU seconds of the run (one thread in-process; FedVCK: "
        "the simulator's processes, FLARE's start-up and messaging included; FedIOD: its teachers' stage 1 included), "
        f"on a shared 2-core machine (1-minute load {results.get('load', '?')} when runs ended; wall time was 2-10x "
        "the CPU time).",
        "",
        *rows,
        "",
        f"FedAvg centralised on the same sites (pooled training images, cls_synthetic's defaults, {args.rounds} epochs "
        f"with the step floor): balanced accuracy {central_line}.",
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", choices=["default", "matched", "all"], default="all")
    p.add_argument("--methods", default="fedavg,fedprox,scaffold,fedvck,fediod,central",
                   help="subset to run (matched: the baselines among them)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--test-per-class", type=int, default=100)
    p.add_argument("--work", type=Path, default=Path("/tmp/medflare_small_sites_methods"))
    p.add_argument("--write-only", action="store_true", help="run nothing: write the markdown from results.json")
    p.add_argument("--rerun", action="store_true", help="run again what results.json already holds")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    store = args.work / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else {"runs": {}}

    def todo(key: str) -> bool:
        """Whether ``key`` is still to run (a finished run is kept unless --rerun)."""
        done = results.get("central") if key == "central" else results["runs"].get(key)
        if done is not None and not args.rerun:
            log(f"{key}: kept from {store}")
        return done is None or args.rerun

    def save(key: str, value: dict) -> None:
        """One finished run into results.json (``central`` beside the runs), with the load it ended at; re-read first,
        so calls running side by side (e.g. ``--methods fediod`` beside ``--settings matched``) keep each other's."""
        if store.is_file():
            on_disk = json.loads(store.read_text())
            results.update({k: v for k, v in on_disk.items() if k != "runs"})
            results["runs"] = {**on_disk.get("runs", {}), **results["runs"]}
        if key == "central":
            results["central"] = value
        else:
            results["runs"][key] = value
        loads = results.setdefault("loads", [])
        loads.append(round(os.getloadavg()[0], 1))
        results["load"] = f"{min(loads):.1f}-{max(loads):.1f}"
        store.write_text(json.dumps(results, indent=1, default=float))
        log(f"{key}: {value}")

    chosen = args.methods.split(",")
    test = balanced_test(args.classes, args.test_per_class)
    if not args.write_only:
        cfg = get_preset("cls_synthetic", settings_for("fedavg", args.classes))
        data = {s: load_site(s, cfg["data"]) for s in SITES}
        results["sizes"] = {s: len(d.train) for s, d in data.items()}
        log(f"training images per site: {results['sizes']}")
        if args.settings in ("default", "all"):
            for method in [m for m in BASELINES if m in chosen and todo(f"{m}/default")]:
                save(f"{method}/default", run_baseline(method, cfg, data, args.rounds, test, args.classes))
            if "central" in chosen and todo("central"):
                cpu, tic = time.process_time(), time.perf_counter()
                acc, classes = central(cfg, data, args.rounds, test)  # a balanced test set: accuracy = balanced accuracy
                save("central", {"balanced_accuracy": acc, "classes": classes, "seconds": time.process_time() - cpu,
                                 "wall_s": time.perf_counter() - tic})
            if "fedvck" in chosen and todo("fedvck/default"):
                save("fedvck/default", run_fedvck(args.work, args.rounds, test, args.classes))
            if "fediod" in chosen and todo("fediod/default"):
                save("fediod/default", run_fediod(args.rounds, test, args.classes))
        if args.settings in ("matched", "all"):
            for ref in ("fedvck", "fediod"):
                done = results["runs"].get(f"{ref}/default")
                if done is None:
                    log(f"matched to {ref}: its default run has no result yet; run --settings default first")
                    continue
                steps = steps_per_site(int(round(done["steps_per_round"])), len(SITES))
                for method in [m for m in BASELINES if m in chosen and todo(f"{m}/matched {ref}")]:
                    save(f"{method}/matched {ref}", run_baseline(method, cfg, data, args.rounds, test, args.classes, steps=steps))
    text = markdown(results, args)
    old = args.out.read_text() if args.out.is_file() else ""
    args.out.write_text(old.split(MARKER)[0].rstrip("\n") + "\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
