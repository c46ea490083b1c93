"""FedST-separate and FedST-join in the FLARE simulator on the tiny preset, two sites of inverted contrast (site-1 and
site-2, the paper's CT vs MR setting).

Each run checks artifacts, not only FLARE's return code: the generator's L_simple falls; the images a site drew in the
other site's style follow the label maps they were drawn from (a segmentation model trained on the other site's REAL
images segments them far better than when scored against other cases' label maps); the segmentation model learns,
and the cross-domain term is what lifts the inverted site (the same job with lambda 0 does far worse there);
the byte ledger matches the communication-cost formula; the saved file reloads, `medflare sample` writes NIfTI images
in a named site's style and `medflare evaluate` scores its segmentation model. FedST-join also: the images a site drew
in the other site's style have that site's mean intensity in every label class (its domain vector switches the style).
"""

import functools
import json

import numpy as np
import pytest
import torch

from medflare.cli import main as medflare_main
from medflare.common.training import make_loader, make_loss, make_optimizer, train_epochs
from medflare.data import load_site
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import exchange_steps
from medflare.fedst.executor import CACHE_FOLDER
from medflare.fedst.persistor import BEST_FILE_OF, FILE_OF
from medflare.fedst.results import load_fedst_result
from medflare.metrics import dice
from medflare.nets import build_from_spec
from medflare.presets import get_preset
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

PRESET = "fedst_tiny"
CLIENTS = ["site-1", "site-2"]
ROUNDS = 3
RECORDER = {"id": "recorder", "path": "medflare.testing.widgets.EventRecorder", "args": {}}


def _run(repo, folder, variant, rounds, workflow_args=None, **kwargs):
    job = f"fedst_{variant}"
    job_dir = customize_job(repo / "jobs" / job, folder / job, preset=PRESET, workflow_args={"num_rounds": rounds, **(workflow_args or {})},
                            server_components=[RECORDER], **kwargs)
    run = run_simulator(job_dir, folder / f"ws_{job}", len(CLIENTS), clients=CLIENTS, timeout=900)
    assert run.returncode == 0, run.log[-4000:]
    assert "EXECUTION_EXCEPTION" not in run.log and "Traceback" not in run.log, run.log[-4000:]
    for name in (FILE_OF[variant], BEST_FILE_OF[variant], "communication.json"):
        assert (run.app_server / name).is_file(), (name, run.log[-3000:])
    return run


def _separate(repo, tmp):
    """One FedST-separate run shared by the tests of this module. The full generator (a WEIGHTS DXO) passes the site's
    result filters like any model: ExcludeVars here (a pattern that matches no tensor, so the store stays complete)."""
    flt = {"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars", "args": {"exclude_vars": "no_such_tensor"}}
    return _run(repo, tmp, "separate", rounds=ROUNDS, task_result_filters=[{"tasks": ["train_generator"], "filters": [flt]}])


def _real_only(repo, tmp):
    """FedST-separate with lambda 0 (Eq. 3 without L_CDS: FedAvg on the real images only), otherwise as ``separate_run``:
    same preset, sites, seed and rounds."""
    return _run(repo, tmp, "separate", rounds=ROUNDS, overrides={"fedst": {"cds_lambda": 0.0}})


def _join(repo, tmp):
    """One FedST-join run with FLARE's PercentilePrivacy on the generator's and the segmentation model's diffs."""
    flt = {"path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy", "args": {"percentile": 5, "gamma": 1.0}}
    return _run(repo, tmp, "join", rounds=ROUNDS, task_result_filters=[{"tasks": ["train_generator", "train"], "filters": [flt]}])


def _join_int4(repo, tmp):
    """FedST-join with the generator's diffs quantized to 4 bits both ways (``diffusion.exchange_dtype`` "int4"), the
    job's own filter chains (the sites' quantizer and manifest check, the server's decoder and update guard)."""
    return _run(repo, tmp, "join", rounds=ROUNDS, overrides={"diffusion": {"exchange_dtype": "int4"}})


#: every run of the module, started in the background (tests/e2e/__init__.py)
RUNS = {"separate_run": _separate, "real_only_run": _real_only, "join_run": _join, "join_int4_run": _join_int4}
separate_run, real_only_run, join_run = simulation("separate_run"), simulation("real_only_run"), simulation("join_run")
join_int4_run = simulation("join_int4_run")
START_FIRST = ("join_run", "join_int4_run")  # the longest (their generator steps keep the other domains' predictions)


@functools.lru_cache(maxsize=None)
def _real_segmenter(site):
    """A segmentation model trained on the real training + validation images of ``site`` only (trained once per site
    and shared by both tests: it depends only on the preset and the site)."""
    cfg = get_preset(PRESET)
    data = load_site(site, cfg["data"])
    cases = [data.train[i] for i in range(len(data.train))] + [data.val[i] for i in range(len(data.val))]
    torch.manual_seed(0)
    model = build_from_spec(cfg["model"])
    train_epochs(model, make_loader(cases, 4, True), make_loss("dicefocal", "segmentation"),
                 make_optimizer("adam", model.parameters(), 1e-2), epochs=30)
    return model.eval()


def _drawn(run, drawer, style):
    """The images ``drawer`` drew in ``style``'s style (its cache) and the label maps they were drawn from."""
    cached = torch.load(run.workspace / drawer / "simulate_job" / f"app_{drawer}" / CACHE_FOLDER / "synthetic" / f"{style}.pt", weights_only=True)
    return cached["images"], cached["labels"]


def _class_means(images, labels):
    return [float(images[labels == c].mean()) for c in range(3)]


def _follows_labels(run, drawer, style):
    """Dice of a model trained on ``style``'s real images on the images ``drawer`` drew in ``style``'s style, against the
    label maps they were drawn from and against other cases' label maps (chance)."""
    images, labels = _drawn(run, drawer, style)
    model = _real_segmenter(style)
    with torch.no_grad():
        pred = model(images).argmax(1, keepdim=True)
    matched = float(dice(pred, labels, 3).nanmean())
    shuffled = float(dice(pred, labels.roll(1, dims=0), 3).nanmean())
    return matched, shuffled


def _check_style_transfer(run):
    """site-2 (inverted) drew images in site-1's style from its own label maps, and vice versa."""
    for drawer, style in (("site-2", "site-1"), ("site-1", "site-2")):
        matched, shuffled = _follows_labels(run, drawer, style)
        assert matched > 0.45 and matched > shuffled + 0.2, (drawer, style, matched, shuffled)


def _check_drawn_style(run):
    """The images each site drew in the other's style have, in every label class, a mean intensity on the other site's
    side of the midpoint between the two sites' real means (the sites' contrasts are inverted, so an image in the average
    style -- what FedST-join drew when its generator was averaged only once per round -- fails every class)."""
    data = {s: load_site(s, get_preset(PRESET)["data"]).train for s in CLIENTS}
    real = {s: _class_means(torch.stack([d[i]["image"] for i in range(len(d))]), torch.stack([d[i]["label"] for i in range(len(d))]))
            for s, d in data.items()}
    for drawer, style in (("site-2", "site-1"), ("site-1", "site-2")):
        drawn = _class_means(*_drawn(run, drawer, style))
        for c in range(3):
            midpoint = (real[style][c] + real[drawer][c]) / 2
            assert (drawn[c] - midpoint) * (real[style][c] - real[drawer][c]) > 0, (drawer, style, c, drawn, real)


def _check_common(run, variant, tmp_path):
    scalars = run.site_scalars()
    assert sorted(scalars) == CLIENTS
    for site in CLIENTS:
        curve = [v for _, v in scalars[site]["generator/loss_curve"]]
        assert np.mean(curve[-3:]) < 0.5 * np.mean(curve[:3]), f"{site}: L_simple {curve}"
        val = dict(scalars[site]["val_global/dice"])
        first, last = val[min(val)], val[max(val)]
        assert last > first + 0.2, f"{site}: validation Dice {val}"
        assert {"comm/train_sent_bytes", "comm/train_generator_sent_bytes", "train/loss_cds", "final/test_dice"} <= set(scalars[site])
    # real-vs-synthetic panels and cross-domain overlays stay in each site's own TensorBoard (no site opted in)
    assert sum(run.site_images().get(site, 0) for site in CLIENTS) >= 2 * len(CLIENTS), run.site_images()
    assert not any(run.images().get(site) for site in CLIENTS), run.images()
    assert run.egress_violations() == []

    ledger = json.loads((run.app_server / "communication.json").read_text())["summary"]
    assert ledger["measured_generator_bytes"] == ledger["predicted_generator_bytes"] > 0
    assert ledger["measured_segmentation_bytes"] == ledger["predicted_segmentation_bytes"] > 0

    events = [json.loads(line) for line in (run.server_dir / "events.jsonl").read_text().splitlines()]
    started = [e["round"] for e in events if e["event"].endswith("_round_started")]
    assert started == sorted(set(started)) and len(started) >= 2

    # the saved file: evaluate its segmentation model, sample in a named site's style from a user's label maps
    result = load_fedst_result(run.app_server / FILE_OF[variant])
    assert result.domains == CLIENTS
    out = tmp_path / f"eval_{variant}.json"
    assert medflare_main(["evaluate", "--model", str(run.app_server / FILE_OF[variant]), "--sites", ",".join(CLIENTS), "--out", str(out)]) == 0
    evaluation = json.loads(out.read_text())["evaluations"][0]
    assert evaluation["client_average"]["dice"] > 0.4 and "vi" in evaluation["client_average"] and "mpa" in evaluation["client_average"]
    labels = load_site("site-2", get_preset(PRESET)["data"]).source
    samples = tmp_path / f"samples_{variant}"
    assert medflare_main(["sample", "--model", str(run.app_server / FILE_OF[variant]), "--labels", str(labels), "--domain", "site-1",
                          "--out", str(samples)]) == 0
    assert len(list(samples.glob("*_synthetic.nii.gz"))) > 0
    assert medflare_main(["sample", "--model", str(run.app_server / FILE_OF[variant]), "--labels", str(labels), "--domain", "site-9",
                          "--out", str(samples)]) == 2


def test_fedst_separate(separate_run, tmp_path):
    run = separate_run
    assert run.log.count("result filters ['ExcludeVars']") == len(CLIENTS), run.log[-3000:]
    _check_common(run, "separate", tmp_path)
    _check_style_transfer(run)
    # the style store went out once: each site received the other's generator in round 0 only
    rows = json.loads((run.app_server / "communication.json").read_text())["rows"]
    downloads = {(r["round"], r["site"]) for r in rows if r["task"] == "sample" and r["to_site"] > 0}
    assert downloads == {(0, s) for s in CLIENTS}


def test_fedst_cross_domain_term_helps_the_inverted_site(separate_run, real_only_run):
    """Eq. 3's L_CDS is what lifts the inverted site: the same FedST-separate job with lambda 0 (real images only) and
    with the default lambda 1, same seed and rounds; the final segmentation model's test Dice at each site."""
    assert f"{ROUNDS} rounds, lambda 1.0" in separate_run.log and f"{ROUNDS} rounds, lambda 0.0" in real_only_run.log  # as configured
    dice_of = {name: {site: series["final/test_dice"][-1][1] for site, series in run.site_scalars().items()}
               for name, run in (("default", separate_run), ("lambda 0", real_only_run))}
    # measured at fedst_tiny: site-2 (inverted, 7 training cases) 0.51 vs 0.24; mean over both sites 0.54 vs 0.50
    assert dice_of["default"]["site-2"] > dice_of["lambda 0"]["site-2"] + 0.1, dice_of
    assert np.mean(list(dice_of["default"].values())) > np.mean(list(dice_of["lambda 0"].values())), dice_of


def test_fedst_join_with_percentile_privacy_on_the_generator_diffs(join_run, tmp_path):
    run = join_run
    _check_common(run, "join", tmp_path)
    _check_drawn_style(run)
    _check_style_transfer(run)
    # the generator's diffs passed the site's result filter like the segmentation diffs (FLARE's PercentilePrivacy)
    diffusion = DiffusionConfig.from_preset(get_preset(PRESET))  # sync_steps splits a round, warmup_sync_steps a warm-up one
    exchanges = len(exchange_steps(diffusion, warmup=True)) * diffusion.warmup_rounds + len(exchange_steps(diffusion)) * ROUNDS
    assert run.log.count("train_generator: site-1 sent") == exchanges
    assert run.log.count("result filters ['PercentilePrivacy']") >= len(CLIENTS) * (exchanges + ROUNDS)


def test_fedst_join_bytes_stay_within_five_times_fedst_separates(join_run):
    """Issue 32: FedST-join's generator costs at most about one whole-generator exchange per site and round (the
    server's ledger of what crossed the wire, the payload totals), and the job's bytes stay under 5x what FedST-separate
    sends with the same sites, rounds and segmentation model (its generators once: c^2 G). Averaging the whole
    generator every 5 local steps (``sync_steps`` 5, ``sync_layers`` all: 16 exchanges per round) sent 50x."""
    summary = json.loads((join_run.app_server / "communication.json").read_text())["summary"]
    c, rounds, g = summary["sites"], summary["generator_rounds"], summary["generator_bytes_each"]
    generator = summary["measured_generator_bytes"]
    assert generator <= 1.1 * 2 * c * rounds * g, (generator, 2 * c * rounds * g, summary)
    others = summary["measured_total_bytes"] - generator  # segmentation + final validation: the same in both variants
    separate = summary["separate_bytes_same_sites"] + others
    assert summary["measured_total_bytes"] < 5 * separate, (summary["measured_total_bytes"] / separate, summary)


def test_fedst_join_with_4_bit_diffs_follows_style_at_under_a_third_of_the_bytes(join_int4_run, join_run, tmp_path):
    """``exchange_dtype`` "int4": the same job as ``join_run`` (float16) learns as it does (L_simple falls, Dice rises,
    each site draws the other's contrast), each generator transfer after a site's first is under 2/7 of a float16 one,
    and the server's ledger equals the prediction (the first download whole, every later transfer a 4-bit diff)."""
    run = join_int4_run
    _check_common(run, "join", tmp_path)
    _check_drawn_style(run)
    quantized = json.loads((run.app_server / "communication.json").read_text())["summary"]
    plain = json.loads((join_run.app_server / "communication.json").read_text())["summary"]
    assert quantized["exchange_dtype"] == "int4" and quantized["generator_exchanges"] == plain["generator_exchanges"]
    assert 7 * quantized["generator_bytes_each"] < 2 * plain["generator_bytes_each"], (quantized, plain)
    assert quantized["measured_generator_bytes"] < 0.4 * plain["measured_generator_bytes"], (quantized, plain)
    assert "refused" not in run.log
