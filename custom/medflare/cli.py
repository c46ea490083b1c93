"""The ``medflare`` command: make data, score saved models, run the non-federated baselines.

    medflare data --preset seg_synthetic -n 4 --out DIR          write sites' data for MEDFLARE_DATA=DIR
    medflare evaluate --model FILE --datalist JSON [--split testing] [--out results.json]
    medflare evaluate --model FILE --npz FILE [--split testing]
    medflare evaluate --model FILE --site site-1                  (the site's configured or embedded data)
    medflare evaluate --model FILE --sites site-1,site-2 | -n 4   per-site, client-average and global table
    medflare evaluate --model FedSM_super_model.pt --site site-6 --gamma 0,0.5,0.9
                                   FedSM super model (Algorithm 2) at each gamma, with selection frequencies
    medflare baseline --mode local|central --preset P -n 4 --epochs 10 [--out results.json]

Every user error (missing file, unknown preset, wrong shapes) exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from medflare import MedflareError
from medflare.common.training import make_loader

DATALIST_SPLITS = {"training": "train", "validation": "val", "testing": "test"}


def _sites(args) -> list[str]:
    if args.sites:
        return [s.strip() for s in args.sites.split(",") if s.strip()]
    return [f"site-{i}" for i in range(1, args.n + 1)]


def cmd_data(args) -> dict[str, Any]:
    from medflare.data import make_cls_sites, make_seg_site
    from medflare.presets import get_preset

    data = get_preset(args.preset)["data"]
    params = {k: v for k, v in data.items() if k not in ("kind",)}
    if data["kind"] == "synthetic_seg":
        paths = {s: str(make_seg_site(s, args.out, **params)) for s in _sites(args)}
    elif data["kind"] == "synthetic_cls":
        params["num_sites"] = args.n
        paths = {s: str(p) for s, p in make_cls_sites(args.out, **params).items()}
    else:
        raise MedflareError(f"preset '{args.preset}' reads a site's own data; only synthetic presets can be generated")
    print(f"wrote {len(paths)} sites to {args.out}; use them with MEDFLARE_DATA={args.out}")
    return paths


def _datasets(args, desc) -> dict[str, tuple]:
    """``{name: (dataset, task, num_classes)}``: one datalist, .npz or site, or several sites (--sites / -n)."""
    from medflare.data import load_npz_split, load_seg_split, load_site

    num_classes = desc["data"]["num_classes"]
    if args.datalist:
        return {args.datalist: (load_seg_split(args.datalist, args.split, num_classes=num_classes), "segmentation", num_classes)}
    if args.npz:
        return {args.npz: (load_npz_split(args.npz, DATALIST_SPLITS.get(args.split, args.split)), "classification", num_classes)}
    out = {}
    for name in [args.site] if args.site else _sites(args):
        site = load_site(name, desc["data"])
        out[name] = (getattr(site, DATALIST_SPLITS.get(args.split, args.split)), site.task, site.num_classes)
    return out


def _gammas(args, stored) -> list[float]:
    try:
        gammas = [float(g) for g in args.gamma.split(",")] if args.gamma else [stored if stored is not None else 0.9]
    except ValueError:
        raise MedflareError(f"--gamma must be comma-separated numbers in [0, 1], got '{args.gamma}'") from None
    if not all(0 <= g <= 1 for g in gammas):
        raise MedflareError(f"--gamma values must lie in [0, 1], got {gammas}")
    return gammas


def _score(model, predict, sources, metrics, verbose, sites=(), label="model") -> dict[str, Any]:
    from medflare.common.report import markdown_table, site_table
    from medflare.fedsm.routing import selection_frequency
    from medflare.metrics import evaluate

    per_site = {}
    for name, (dataset, task, num_classes) in sources.items():
        if predict is not None:
            predict.reset()
        result = evaluate(model, make_loader(dataset, 8, False), task=task, num_classes=num_classes, metrics=metrics, predict=predict)
        if predict is not None:
            result["selection"] = selection_frequency(predict.choices, sites)
        prefix = f"{name}: " if len(sources) > 1 else ""
        if verbose:
            for case in result["per_case"]:
                print(prefix + "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in case.items()))
        print(prefix + "mean: " + "  ".join(f"{k}={v:.4f}" for k, v in result["mean"].items()))
        if "selection" in result:
            print(prefix + "selected: " + "  ".join(f"{k}={v:.3f}" for k, v in result["selection"].items()))
        per_site[name] = result
    if len(per_site) == 1:
        return next(iter(per_site.values()))
    table = site_table(per_site)
    key = next(iter(table["client_average"]), None)
    print(markdown_table({label: table}, metric=key or "dice"))
    if predict is not None:
        print(selection_table({site: r["selection"] for site, r in per_site.items()}))
    return {**table, "per_site": per_site}


def selection_table(freqs: dict[str, dict[str, float]]) -> str:
    """Paper Table 5 layout: one row per evaluated site, the fraction of its cases sent to each model (%)."""
    cols = list(next(iter(freqs.values())))
    lines = ["| test site | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += [f"| {site} | " + " | ".join(f"{100 * f[c]:.1f}" for c in cols) + " |" for site, f in freqs.items()]
    return "\n".join(lines)


def cmd_evaluate(args) -> dict[str, Any]:
    from medflare.common.checkpoint import model_from_checkpoint, read_checkpoint
    from medflare.fedsm.supermodel import is_super_model, super_model_from_checkpoint
    from medflare.presets import get_preset

    data = read_checkpoint(args.model)  # read once, whichever kind of model it holds
    super_model = None
    if args.gamma is not None or is_super_model(data):
        super_model = super_model_from_checkpoint(data, args.model)
        desc = super_model.description
    else:
        model, desc = model_from_checkpoint(data, args.model, preset=args.preset)
    sources = _datasets(args, desc)
    metrics = args.metrics.split(",") if args.metrics else get_preset(desc["preset"])["eval"]["metrics"]
    if super_model is None:
        return _score(model, None, sources, metrics, verbose=True)
    sweep = {}
    for gamma in _gammas(args, super_model.info.get("gamma")):
        print(f"FedSM super model ({len(super_model.sites)} sites), gamma {gamma}:")
        predict = super_model.predictor(gamma)
        sweep[gamma] = {"gamma": gamma, **_score(None, predict, sources, metrics, verbose=len(sources) == 1, sites=super_model.sites,
                                                   label=f"super model, gamma {gamma}")}
    return next(iter(sweep.values())) if len(sweep) == 1 else {"gamma_sweep": sweep}


def cmd_baseline(args) -> dict[str, Any]:
    from medflare.baselines.standalone import run_standalone

    overrides = json.loads(args.overrides) if args.overrides else None
    result = run_standalone(args.mode, args.preset, _sites(args), epochs=args.epochs, overrides=overrides, device=args.device)
    print(f"{args.mode}: client average {result['client_average']}, global {result['global']} ({result['seconds']:.1f} s)")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medflare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_sites(p):
        p.add_argument("-n", type=int, default=4, help="number of sites site-1..site-N (default 4)")
        p.add_argument("--sites", help="comma-separated site names (overrides -n)")

    p = sub.add_parser("data", help="write synthetic sites to a folder (for MEDFLARE_DATA)")
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("--out", required=True)
    add_sites(p)
    p.set_defaults(func=cmd_data, out_json=None)

    p = sub.add_parser("evaluate", help="score a saved model (or FedSM super model) on a datalist, an .npz or sites' data")
    p.add_argument("--model", required=True, help="checkpoint written by a job (FL_global_model.pt, FedSM_super_model.pt, ...)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--datalist", help="Decathlon-style datalist JSON")
    src.add_argument("--npz", help="MedMNIST-layout .npz")
    src.add_argument("--site", help="a site name resolved like a job does (MEDFLARE_DATA or embedded data)")
    src.add_argument("--sites", help="comma-separated site names: per-site, client-average and global table")
    src.add_argument("-n", type=int, help="sites site-1..site-N (as --sites)")
    p.add_argument("--gamma", help="FedSM super model: selector confidence threshold(s), comma-separated "
                   "(default: the job's, else 0.9)")
    p.add_argument("--split", default="testing", help="training | validation | testing (default testing)")
    p.add_argument("--preset", help="preset of a checkpoint that does not describe itself")
    p.add_argument("--metrics", help="comma-separated metric names (default: the preset's)")
    p.add_argument("--out", dest="out_json", help="write per-case and mean results as JSON")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("baseline", help="local-only or centralised training on the sites' data")
    p.add_argument("--mode", required=True, choices=["local", "central"])
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--overrides", help='JSON merged into the preset, e.g. \'{"train": {"lr": 0.001}}\'')
    p.add_argument("--device", default="auto")
    p.add_argument("--out", dest="out_json", help="write the results table as JSON")
    add_sites(p)
    p.set_defaults(func=cmd_baseline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except MedflareError as e:
        print(f"medflare {args.command}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "out_json", None):
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=2, default=float)
        print(f"results written to {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
