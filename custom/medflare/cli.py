"""The medflare command: run or submit a job, make data, inspect and score saved results, write predictions and samples,
run the non-federated baselines, audit a job, build the report.

    medflare run fedsm -n 4 [--preset P] [--set train.lr=0.01] [--rounds 5]   a job in FLARE's simulator (SimEnv)
    medflare submit fedsm --startup-kit KIT [--set ...]          an exported copy of a job to a POC/real federation
    medflare presets                                             the presets, one line each
    medflare data --preset seg_synthetic -n 4 --out DIR          write sites' data for MEDFLARE_DATA=DIR
    medflare data --from-folder DIR [--out DIR/datalist.json]    a datalist for a folder of image/label pairs
    medflare show --model FILE                                   what a saved result is and what it holds
    medflare evaluate --model FILE --datalist JSON [--split testing] [--out results.json] [--verbose]
    medflare evaluate --model FILE --npz FILE                    classification: per-class accuracy, confusion matrix
    medflare evaluate --model FILE --site site-1 | --sites a,b | -n 4   (sites' configured or embedded data)
                      volumes: per volume, on the stored grid, distances in mm
    medflare predict --model FILE --datalist JSON --out DIR      one label map per image, with the image's affine and header
    medflare sample --model FILE --labels JSON --out DIR         images generated from label maps (generators)
    medflare baseline --mode local|central --preset P -n 4 --epochs 10 [--out results.json]
    medflare audit jobs/fedavg                                   what a job's sites send, before approving it
    medflare report --quick --out DIR                            every method on the same sites: REPORT.md, tables, figures

A saved result says what kind it is; the kind decides what it can do (see 'medflare show') and which extra
options it takes (listed under the kind's header in each command's help). Every user error (missing file,
unknown preset, wrong shapes) exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from medflare import ConfigError, MedflareError, __version__
from medflare.common.options import declared_options, options_for


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``-n 0`` is an error, not "the default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _sites(args) -> list[str]:
    if args.sites:
        return [s.strip() for s in args.sites.split(",") if s.strip()]
    return [f"site-{i}" for i in range(1, (args.n or 4) + 1)]


def cmd_data(args) -> dict[str, Any]:
    from medflare.data import make_cls_sites, make_seg_site
    from medflare.presets import get_preset

    if args.from_folder:
        return _datalist_from_folder(args)
    if not args.out:
        raise ConfigError("medflare data: --out FOLDER is required (or --from-folder DIR)")
    data = get_preset(args.preset)["data"]
    params = {k: v for k, v in data.items() if k not in ("kind",)}
    if data["kind"] == "synthetic_seg":
        paths = {s: str(make_seg_site(s, args.out, **params)) for s in _sites(args)}
    elif data["kind"] == "synthetic_cls":
        params["num_sites"] = args.n
        paths = {s: str(p) for s, p in make_cls_sites(args.out, **params).items()}
    else:
        raise ConfigError(f"preset '{args.preset}' reads a site's own data; only synthetic presets can be generated")
    print(f"wrote {len(paths)} sites to {args.out}; use them with MEDFLARE_DATA={args.out}")
    return paths


def _datalist_from_folder(args) -> dict[str, Any]:
    from medflare.data.datalists import SEG_SPLITS, datalist_from_folder

    out = Path(args.out) if args.out else Path(args.from_folder) / "datalist.json"
    if out.suffix != ".json":
        raise ConfigError(f"medflare data --from-folder: --out '{out}' must be a .json file")
    content = datalist_from_folder(args.from_folder, out, val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                                   seed=args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(content, indent=2))
    counts = ", ".join(f"{k} {len(content.get(k, []))}" for k in (*SEG_SPLITS, "test") if content.get(k))
    print(f"wrote {out}: {counts}" + (f"; {len(content['unmatched'])} image(s) without a label listed under 'unmatched'"
                                       if content.get("unmatched") else ""))
    print(f"point a site at it: MEDFLARE_DATA=<folder holding <site>.json>, or local/medflare_data.json {{\"datalist\": \"{out}\"}}")
    return {"datalist": str(out), **{k: len(v) for k, v in content.items() if isinstance(v, list)}}


# ---- results ---------------------------------------------------------------------------------
def _load(args):
    from medflare.evaluation import open_result

    return open_result(args.model, getattr(args, "preset", None), args.device)


def _raw_kind_options(args) -> dict[str, str | None]:
    """``{option name: text or None}`` of every registered kind's options, as given on the command line."""
    return {o.name: getattr(args, o.name, None) for declared in declared_options().values() for o in declared.options}


def _kind_options(args, result) -> dict[str, Any]:
    """The values of the options the result's kind declares; an option of another kind is an error."""
    from medflare.evaluation import kind_options

    return kind_options(result, _raw_kind_options(args), args.model)


def cmd_evaluate(args) -> dict[str, Any]:
    from medflare.evaluation import evaluate_result

    sites = [args.site] if args.site else (_sites(args) if args.sites or args.n else None)
    return evaluate_result(args.model, datalist=args.datalist, npz=args.npz, sites=sites, split=args.split,
                           metrics=args.metrics.split(",") if args.metrics else None, batch_size=args.batch_size,
                           verbose=args.verbose, preset=args.preset, device=args.device, options=_raw_kind_options(args))


def cmd_show(args) -> dict[str, Any]:
    from medflare.common.results import kinds

    result, _ = _load(args)
    kind = kinds()[result.kind]
    print(f"{args.model}: kind '{result.kind}' (version {result.description.get('version', 1)}): {kind.summary}")
    print(f"preset '{result.description['preset']}', overrides {result.description.get('overrides') or {}}")
    for name, what in result.parts().items():
        print(f"  {name}: {what}")
    for key, value in result.info.items():
        print(f"  {key}: {_shown(key, value)}")
    if kind.options:
        print("options: " + ", ".join(f"--{o.name}" for o in kind.options))
    return {"kind": result.kind, "description": result.description, "parts": result.parts(), "info": result.info}


def _shown(key: str, value: Any) -> str:
    """An ``info`` entry for a person: the scores under ``metrics`` in percent (``dice 71.23 %``), other numbers with 4
    significant digits, dicts as ``name value`` pairs."""
    from medflare.common.report import format_metric

    if isinstance(value, dict) and value:
        return ", ".join(f"{k} {format_metric(k, v) if key == 'metrics' and not isinstance(v, dict) else _shown(k, v)}"
                         for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def cmd_predict(args) -> dict[str, Any]:
    from medflare.data.writeback import write_predictions

    result, device = _load(args)
    options = _kind_options(args, result)
    (label, predictor), *rest = result.predictors(options)
    if rest:
        raise ConfigError(f"predict writes one prediction per image; give one value for the options of kind '{result.kind}'")
    written = write_predictions(predictor, result.description["data"], args.out, device, datalist=args.datalist,
                                npz=args.npz, split=args.split, batch_size=args.batch_size)
    print(f"{label}: wrote {len(written)} predictions to {args.out}")
    return {"model": str(args.model), "label": label, "written": [str(p) for p in written]}


def cmd_sample(args) -> dict[str, Any]:
    from medflare.data.writeback import write_samples

    result, device = _load(args)
    options = _kind_options(args, result)
    written = write_samples(result, options, args.out, device, labels=args.labels, split=args.split, num=args.num,
                            seed=args.seed)
    print(f"wrote {len(written)} samples to {args.out}")
    return {"model": str(args.model), "written": [str(p) for p in written]}


def cmd_baseline(args) -> dict[str, Any]:
    from medflare.baselines.standalone import run_standalone

    overrides = json.loads(args.overrides) if args.overrides else None
    result = run_standalone(args.mode, args.preset, _sites(args), epochs=args.epochs, overrides=overrides, device=args.device)
    print(f"{args.mode}: client average {result['client_average']}, global {result['global']} ({result['seconds']:.1f} s)")
    return result


def cmd_audit(args) -> dict[str, Any]:
    from medflare.common.egress import audit_job

    audit = audit_job(args.job)
    print(f"job '{audit['job']}' (preset '{audit['preset']}') runs under the sites' privacy scope '{audit['scope']}'; "
          "each site sends, per task, only these parts (a site refuses anything else):")
    print(f"  {'task':<18} {'part':<24} {'kind':<22} {'at most':>12}  {'cadence':<13} what")
    for r in audit["parts"]:
        bound = f"{r['max_bytes']:,} B" if r["max_bytes"] is not None else ("numbers" if r["kind"] == "METRICS" else "-")
        print(f"  {r['task']:<18} {r['part']:<24} {r['kind']:<22} {bound:>12}  {r['cadence']:<13} {r['what']}")
    print(f"at most {audit['max_bytes_per_round']:,} B per site and round in the parts sent every round with a bound"
          + (f"; no bound computed for {', '.join(audit['unbounded'])} (sized by the job's settings and the site's data)"
             if audit["unbounded"] else ""))
    print(f"analytics: {audit['analytics']}")
    return audit


def cmd_run(args) -> dict[str, Any]:
    from medflare.jobs.run import run_job

    return run_job(args.job, args.n, root=args.workspace_root, preset=args.preset, assignments=args.set or [],
                   rounds=args.rounds, seed=args.seed, verbose=args.verbose)


def cmd_submit(args) -> dict[str, Any]:
    from medflare.jobs.submit import submit_job

    return submit_job(args.job, args.startup_kit, username=args.username, preset=args.preset, assignments=args.set or [],
                      rounds=args.rounds, seed=args.seed, byoc=args.byoc)


def cmd_report(args) -> dict[str, Any]:
    from medflare.presets import overrides_from_assignments
    from medflare.report.build import plan, report

    def listed(text, cast=str):
        return [cast(x.strip()) for x in text.split(",") if x.strip()] if text else None

    rows = plan(listed(args.tasks), "quick" if args.quick else "full", methods=listed(args.methods),
                sites=listed(args.sites), seeds=listed(args.seeds, int), rounds=args.rounds, skews=listed(args.skews, float),
                match=listed(args.match_compute), settings=overrides_from_assignments(args.set or []))
    path, failed = report(Path(args.out), rows, rerun=args.rerun, write_only=args.write_only)
    print(f"report written to {path}" + (f"; {len(failed)} of {len(rows)} rows failed (listed in it)" if failed else ""))
    if failed:
        raise MedflareError(f"{len(failed)} of {len(rows)} report rows failed: {'; '.join(failed)}")
    return {"report": str(path), "rows": len(rows)}


# ---- the parser ------------------------------------------------------------------------------
def cmd_presets(args) -> dict[str, Any]:
    from medflare.presets import PRESETS

    rows = {name: _preset_line(name, preset) for name, preset in PRESETS.items()}
    width = max(map(len, rows))
    for name, line in rows.items():
        print(f"{name:<{width}}  {line}")
    return rows


def _preset_line(name: str, preset: dict[str, Any]) -> str:
    """One line: task, data, model, algorithm section, and what the preset is for (from its name's suffix)."""
    data = preset["data"]
    task = "classification" if data["kind"] in ("synthetic_cls", "npz") else "segmentation"
    source = {"npz": "a site's MedMNIST-layout .npz", "datalist": "a site's datalist of images",
              "volumes": "a site's datalist of NIfTI volumes"}.get(data["kind"], "synthetic sites")
    side = data.get("image_size")
    size = f", {'x'.join(map(str, side)) if isinstance(side, list) else f'{side}x{side}'} px" if side else ""
    section = [k for k in ("fedvck", "fediod", "diffusion") if k in preset]
    use = ("end-to-end tests on 2 CPU cores" if name.endswith("_tiny") else "benchmarks on small sites" if name.endswith("_small") else "the paper's scale" if name.endswith("_paper")
           else "a laptop CPU in minutes" if data["kind"].startswith("synthetic") else "hospitals' data")
    return (f"{task}, {source}{size}, model {preset['model']['name']}"
            + (f", {'+'.join(section)} settings" if section else "") + f"; for {use}")


def _add_kind_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of the result kinds that ``command`` applies to, one group per algorithm with the kinds named
    (read from torch-free declarations: building the parser imports no algorithm)."""
    for title, (names, options) in options_for(command).items():
        group = parser.add_argument_group(title, f"only for result files of kind {', '.join(names)}")
        for opt in options:
            group.add_argument(f"--{opt.name}", help=opt.help)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a file a job saved (FL_global_model.pt, a super model, a generator, ...)")
    p.add_argument("--preset", help="preset of a plain state dict that does not describe itself (a result file that names "
                                    "its preset refuses another one)")
    p.add_argument("--device", default="auto", help="auto (first GPU when present) | cpu | cuda[:N] (default auto)")


def build_parser() -> argparse.ArgumentParser:
    """The ``medflare`` parser. It imports no algorithm, torch or MONAI (each command imports what it needs when it
    runs), so every ``--help`` answers in well under a second; each result kind's options come from its torch-free
    declaration (:mod:`medflare.common.options`)."""
    parser = argparse.ArgumentParser(prog="medflare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"medflare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("presets", help="list the presets (dataset, model and training settings a job selects by name)")
    p.set_defaults(func=cmd_presets, out_json=None)

    def add_sites(p):
        p.add_argument("-n", type=_positive, help="sites site-1..site-N (default 4)")
        p.add_argument("--sites", help="comma-separated site names (overrides -n)")

    def add_job_settings(p):
        p.add_argument("job", help="a shipped job: fedavg, fedprox, scaffold, fedsm, fedvck, fediod, fediod_seg, "
                                   "fedst_separate, fedst_join (jobs/<job>/ is its recipe's export)")
        p.add_argument("--preset", help="the preset the job runs with (default: the job folder's; see 'medflare presets')")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a preset value, e.g. --set train.lr=0.01 --set train.epochs=2 (repeatable; "
                            "the value is read as JSON when it parses); an unknown key is an error naming it")
        p.add_argument("--rounds", type=_positive, help="rounds of the job (default: the job folder's)")
        p.add_argument("--seed", type=int, help="seed of the job's persistor, executors and workflow (initial weights, "
                                                "shuffling, the algorithm's own noise; default: the job folder's, 0)")

    p = sub.add_parser("run", help="run a job in FLARE's simulator (its recipe in SimEnv): one line per round, then the result",
                       description="Run a shipped job's FLARE 2.9 recipe in FLARE's simulator environment (SimEnv), one "
                                   "thread per site. Prints one line per round (the mean over sites of the job's key "
                                   "metric, the round's seconds) and FLARE's warnings, then the result file and the "
                                   "'medflare evaluate' command that scores it. The job folder itself runs with "
                                   "'nvflare simulator jobs/<job> -w WS -n N -t N'.")
    add_job_settings(p)
    p.add_argument("-n", type=_positive, default=4, help="simulated sites site-1..site-N (default 4)")
    p.add_argument("-w", "--workspace-root", default="/tmp/medflare",
                   help="the run's workspace is ROOT/<job> (FLARE's SimEnv layout; default /tmp/medflare)")
    p.add_argument("--verbose", action="store_true", help="print FLARE's whole (concise) console, not only the round lines")
    p.add_argument("--out", dest="out_json", help="write the run's summary (workspace, result, command) as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("submit", help="submit a job to a POC or provisioned federation (an exported copy: jobs/ stays as it is)",
                       description="Export the job's recipe with the given settings to a temporary folder, without "
                                   "app/custom (the shipped site templates refuse bring-your-own-code jobs), and submit "
                                   "that copy with FLARE's Session API; FLARE signs the copy, never jobs/<job>.")
    add_job_settings(p)
    p.add_argument("--startup-kit", required=True, help="the submitting admin's startup kit folder")
    p.add_argument("--username", help="the admin's user name (default: the kit folder's name, as FLARE provisions it)")
    p.add_argument("--byoc", action="store_true",
                   help="keep app/custom (only for a federation whose sites admit bring-your-own-code jobs)")
    p.add_argument("--out", dest="out_json", help="write the job id and the copy's settings as JSON")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("data", help="write synthetic sites to a folder (for MEDFLARE_DATA), or a datalist for a folder")
    p.add_argument("--preset", default="seg_synthetic",
                   help="a synthetic preset whose sites to write (default seg_synthetic; see 'medflare presets')")
    p.add_argument("--out", help="folder for synthetic sites; with --from-folder the datalist file (default DIR/datalist.json)")
    p.add_argument("--from-folder", metavar="DIR",
                   help="write a datalist for DIR's image/label pairs (imagesTr/labelsTr, images/masks, one folder per case)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="with --from-folder: validation cases (default 0.2)")
    p.add_argument("--test-fraction", type=float, default=0.2, help="with --from-folder: testing cases (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="with --from-folder: seed of the split (default 0)")
    add_sites(p)
    p.set_defaults(func=cmd_data, out_json=None)

    p = sub.add_parser("show", help="what a saved result is, its networks and settings")
    _add_model(p)
    p.add_argument("--out", dest="out_json", help="write the description as JSON")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("evaluate", help="score a saved result on a datalist, an .npz or sites' data")
    _add_model(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--datalist", help="Decathlon-style datalist JSON")
    src.add_argument("--npz", help="MedMNIST-layout .npz")
    src.add_argument("--site", help="a site name resolved like a job does (MEDFLARE_DATA or embedded data)")
    src.add_argument("--sites", help="comma-separated site names: per-site, client-average and global table")
    src.add_argument("-n", type=_positive, help="sites site-1..site-N (as --sites)")
    p.add_argument("--split", default="testing", help="training | validation | testing (default testing)")
    p.add_argument("--metrics", help="comma-separated metric names (default: the preset's)")
    p.add_argument("--batch-size", type=_positive, default=8, help="images per forward pass (default 8)")
    p.add_argument("--verbose", action="store_true", help="also print one line per case")
    p.add_argument("--out", dest="out_json", help="write per-site, per-case and mean results as JSON")
    _add_kind_options(p, "evaluate")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("predict", help="write a prediction per image (NIfTI with the image's affine; CSV for classification)")
    _add_model(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--datalist", help="Decathlon-style datalist JSON")
    src.add_argument("--npz", help="MedMNIST-layout .npz")
    p.add_argument("--split", default="testing", help="training | validation | testing (default testing)")
    p.add_argument("--out", required=True, help="folder for the predictions")
    p.add_argument("--batch-size", type=_positive, default=8, help="images per forward pass (default 8; it changes no prediction)")
    _add_kind_options(p, "predict")
    p.set_defaults(func=cmd_predict, out_json=None)

    p = sub.add_parser("sample", help="generate images from label maps (or unconditioned) with a saved generator")
    _add_model(p)
    p.add_argument("--labels", help="datalist JSON whose label maps condition the generator")
    p.add_argument("--split", default="testing", help="datalist split of --labels (default testing)")
    p.add_argument("--num", type=_positive, default=8, help="images for an unconditioned generator (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator's noise: the same seed gives the same images (default 0)")
    p.add_argument("--out", required=True, help="folder for the images (NIfTI)")
    _add_kind_options(p, "sample")
    p.set_defaults(func=cmd_sample, out_json=None)

    p = sub.add_parser("baseline", help="local-only or centralised training on the sites' data")
    p.add_argument("--mode", required=True, choices=["local", "central"],
                   help="local: each site trains alone on its own data; central: one model on all sites' data pooled")
    p.add_argument("--preset", default="seg_synthetic", help="dataset, model and training settings (default seg_synthetic; "
                                                             "see 'medflare presets')")
    p.add_argument("--epochs", type=_positive, default=10, help="training epochs (default 10)")
    p.add_argument("--overrides", help='JSON merged into the preset, e.g. \'{"train": {"lr": 0.001}}\'')
    p.add_argument("--device", default="auto", help="auto (first GPU when present) | cpu | cuda[:N] (default auto)")
    p.add_argument("--out", dest="out_json", help="write the results table as JSON")
    add_sites(p)
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("audit", help="what a job's sites will send (parts, kinds, byte bounds, cadence), before approving it",
                       description="Print the job folder's declared manifest of what leaves each site, with the byte bounds "
                                   "at the job's preset, its privacy scope and the analytics rule (app_configs/README.md).")
    p.add_argument("job", type=Path, help="a job folder, e.g. jobs/fedavg")
    p.add_argument("--out", dest="out_json", help="write the audit as JSON")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("report", help="every algorithm and baseline on the same sites: REPORT.md, CSV, JSON, figures",
                       description="Run (or reuse) each method's job in the FLARE simulator on the same sites and score it "
                                   "the same way; see docs/report.md.")
    p.add_argument("--tasks", default="seg,cls", help="seg, cls or both (default seg,cls)")
    p.add_argument("--out", required=True, help="output folder (records/ in it make a rerun resume)")
    p.add_argument("--quick", action="store_true", help="small sites, 2 rounds, tiny presets (578 s on 2 CPU cores, measured for the README)")
    p.add_argument("--methods", help="comma-separated subset, e.g. fedavg,fedsm,local (default: every method of the task)")
    p.add_argument("--sites", help="comma-separated site names (default site-1..site-N of the mode); with MEDFLARE_DATA, your sites")
    p.add_argument("--seeds", help="comma-separated seeds (default: 0 in --quick mode, 0,1,2 in full mode)")
    p.add_argument("--rounds", type=_positive, help="rounds per job (default: 2 quick, 10 full; full mode runs FedSM and FedSM-extra at twice the rounds and FedIOD-seg at three times, their jobs' own schedules)")
    p.add_argument("--skews", help="Dirichlet betas of the classification tables (default 0.5,0.05)")
    p.add_argument("--match-compute", metavar="METHODS",
                   help="also run the baselines (fedavg, fedprox, scaffold) at the optimisation steps per round of these "
                        "methods, e.g. fedvck,fediod (docs/report.md, 'Matched compute')")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a preset value in every row, e.g. --set data.scale=0.25 (every site with a quarter "
                        "of its cases; repeatable, as for 'medflare run'); records remember it, and a folder run with "
                        "other settings is refused, so give the report its own --out")
    p.add_argument("--rerun", action="store_true", help="run every row again instead of reusing finished ones")
    p.add_argument("--write-only", action="store_true",
                   help="run nothing: write the report from the finished rows, listing the others as not run yet")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except MedflareError as e:
        print(f"medflare {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "out_json", None):
        Path(args.out_json).write_text(json.dumps(result, indent=2, default=float))
        print(f"results written to {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
