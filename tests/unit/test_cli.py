"""`medflare` on tiny data: its numbers equal the metric functions on the same predictions, it prints a summary
(not a line per case), reads every registered result kind, and answers bad input with one line naming it."""

import json

import numpy as np
import pytest
import torch

from medflare.cli import main
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe
from medflare.common.training import make_loader
from medflare.data import load_npz_split, load_site
from medflare.metrics import evaluate
from medflare.presets import get_preset

TINY = "seg_synthetic_tiny"


def _checkpoint(path, preset=TINY, seed=0):
    model = model_from_preset(preset, seed=seed)
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(preset)}}, path)
    return path, model


def _direct(model, dataset, preset=TINY):
    """What the metric layer says about ``model`` on ``dataset``, computed without the CLI."""
    cfg = get_preset(preset)
    task = "classification" if cfg["data"]["kind"].endswith("cls") or cfg["data"]["kind"] == "npz" else "segmentation"
    return evaluate(model.eval(), make_loader(dataset, 8, False), task=task, num_classes=cfg["data"]["num_classes"],
                    metrics=cfg["eval"]["metrics"])


def test_evaluate_equals_the_metric_functions_and_prints_a_summary(tmp_path, capsys):
    ckpt, model = _checkpoint(tmp_path / "m.pt")
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    site = result["evaluations"][0]["sites"]["site-1"]
    expected = _direct(model, load_site("site-1", get_preset(TINY)["data"]).test)
    assert site["mean"] == pytest.approx(expected["mean"]) and len(site["per_case"]) == expected["num_cases"]
    printed = capsys.readouterr().out
    assert "| site | cases | dice (%) |" in printed  # the unit in the header
    assert "| site | dice_c1 (%) | dice_c2 (%) |" in printed  # 3 classes: the per-class table too
    assert "name=" not in printed and printed.count("\n") < 16, "a summary, not a line per case"  # per-case rows only with --verbose
    assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--verbose"]) == 0
    assert capsys.readouterr().out.count("name=") == expected["num_cases"]


def test_evaluate_on_several_sites_gives_the_table_3_layout(tmp_path, capsys):
    ckpt, model = _checkpoint(tmp_path / "m.pt")
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(ckpt), "-n", "2", "--out", str(out)]) == 0
    ev = json.loads(out.read_text())["evaluations"][0]
    data = get_preset(TINY)["data"]
    per_site = {s: _direct(model, load_site(s, data).test) for s in ("site-1", "site-2")}
    assert ev["client_average"]["dice"] == pytest.approx(np.mean([r["mean"]["dice"] for r in per_site.values()]))
    pooled = [c["dice"] for r in per_site.values() for c in r["per_case"]]
    assert ev["global"]["dice"] == pytest.approx(np.mean(pooled))
    printed = capsys.readouterr().out
    assert "| client average |" in printed and "| all cases |" in printed  # "global" pooled every case: said so


def test_evaluate_a_classifier_prints_per_class_accuracy_and_a_confusion_matrix(tmp_path, capsys):
    ckpt, model = _checkpoint(tmp_path / "c.pt", preset="cls_synthetic_tiny")
    assert main(["data", "--preset", "cls_synthetic_tiny", "-n", "10", "--out", str(tmp_path / "d")]) == 0
    npz = tmp_path / "d" / "site-1.npz"
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(ckpt), "--npz", str(npz), "--out", str(out)]) == 0
    site = json.loads(out.read_text())["evaluations"][0]["sites"][str(npz)]
    expected = _direct(model, load_npz_split(npz, "test"), preset="cls_synthetic_tiny")
    assert site["mean"]["accuracy"] == pytest.approx(expected["mean"]["accuracy"])
    confusion = np.asarray(site["confusion"])
    labels = [c["label"] for c in expected["per_case"]]
    assert confusion.sum() == len(labels) and confusion.sum(1).tolist() == np.bincount(labels, minlength=10).tolist()
    assert np.trace(confusion) / confusion.sum() == pytest.approx(expected["mean"]["accuracy"])
    assert "true \\ predicted" in capsys.readouterr().out


def test_errors_are_one_line_naming_the_file(tmp_path, capsys):
    assert main(["evaluate", "--model", str(tmp_path / "missing.pt"), "--site", "site-1"]) == 2
    assert "missing.pt" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main(["evaluate", "--model", str(tmp_path / "junk.pt"), "--site", "site-1"]) == 2
    err = capsys.readouterr().err
    assert "junk.pt" in err and err.count("\n") == 1
    torch.save(model_from_preset(TINY).state_dict(), tmp_path / "plain.pt")
    assert main(["evaluate", "--model", str(tmp_path / "plain.pt"), "--site", "site-1"]) == 2
    assert "--preset" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "plain.pt"), "--site", "site-1", "--preset", TINY]) == 0
    ckpt, _ = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "--datalist", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


class _Payload:
    """Runs code when unpickled: a result file must never load it."""

    def __reduce__(self):
        return (print, ("pwned",))


def test_a_pickle_with_code_is_refused_with_one_line(tmp_path, capsys):
    torch.save({"model": _Payload()}, tmp_path / "evil.pt")
    assert main(["evaluate", "--model", str(tmp_path / "evil.pt"), "--site", "site-1"]) == 2
    captured = capsys.readouterr()
    assert "pwned" not in captured.out and "evil.pt" in captured.err and captured.err.count("\n") == 1


def test_unknown_kind_and_newer_version_name_the_file_and_the_known_kinds(tmp_path, capsys):
    model = model_from_preset(TINY)
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(TINY, kind="nope")}}, tmp_path / "k.pt")
    assert main(["show", "--model", str(tmp_path / "k.pt")]) == 2
    err = capsys.readouterr().err
    assert "k.pt" in err and "'nope'" in err and "fedsm_super_model" in err and "'model'" in err
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(TINY, version=99)}}, tmp_path / "v.pt")
    assert main(["show", "--model", str(tmp_path / "v.pt")]) == 2
    assert "v.pt" in (err := capsys.readouterr().err) and "version 99" in err


def test_predict_writes_label_maps_with_the_image_affine(tmp_path):
    import nibabel as nib

    assert main(["data", "--preset", TINY, "-n", "1", "--out", str(tmp_path / "d")]) == 0
    datalist = tmp_path / "d" / "site-1.json"
    entry = json.loads(datalist.read_text())["testing"][0]
    image_file = tmp_path / "d" / entry["image"]
    affine = np.diag([0.5, 0.7, 1.0, 1.0])
    img = nib.load(image_file)
    nib.save(nib.Nifti1Image(img.get_fdata().astype(np.float32), affine), image_file)  # an anisotropic pixel size
    ckpt, model = _checkpoint(tmp_path / "m.pt")
    assert main(["predict", "--model", str(ckpt), "--datalist", str(datalist), "--out", str(tmp_path / "p")]) == 0
    written = sorted((tmp_path / "p").glob("*_pred.nii.gz"))
    assert len(written) == len(json.loads(datalist.read_text())["testing"])
    first = nib.load(tmp_path / "p" / (image_file.name.replace(".nii.gz", "") + "_pred.nii.gz"))
    assert np.allclose(first.affine, affine) and first.shape == img.shape
    image = torch.as_tensor(img.get_fdata(), dtype=torch.float32)[None, None]
    image = (image - image.min()) / (image.max() - image.min())
    assert np.array_equal(first.get_fdata(), model(image).argmax(1)[0].numpy())


def test_sample_on_a_model_that_cannot_sample_says_so(tmp_path, capsys):
    ckpt, _ = _checkpoint(tmp_path / "m.pt")
    assert main(["sample", "--model", str(ckpt), "--out", str(tmp_path / "s")]) == 2
    assert "cannot sample" in capsys.readouterr().err


def test_local_and_central_baselines_learn(tmp_path):
    out = tmp_path / "central.json"
    args = ["baseline", "--preset", TINY, "--sites", "site-1,site-3", "--epochs", "8", "--device", "cpu"]
    assert main(args + ["--mode", "central", "--out", str(out)]) == 0
    central = json.loads(out.read_text())
    assert central["curve"][-1] > central["curve"][0] + 0.2, central["curve"]
    assert central["client_average"]["dice"] > 0.5
    assert set(central["sites"]) == {"site-1", "site-3"}
    assert main(args + ["--mode", "local", "--out", str(out)]) == 0
    local = json.loads(out.read_text())
    assert local["mode"] == "local" and local["client_average"]["dice"] > 0.3


# ---- a registered kind other than "model": the FedSM super model ------------------------------
def _super_model(path, sites=("site-1", "site-2")):
    """Global and personalised models with different weights; a selector that finds every case fully typical of site index 1."""
    from medflare.fedsm.selector import selector_spec
    from medflare.fedsm.persistor import save_super_model
    from medflare.fedsm.results import super_model_description
    from medflare.fedsm.supermodel import super_model_network

    nets = {name: model_from_preset(TINY, seed=seed) for name, seed in (("global", 0), ("p0", 1), ("p1", 2))}
    spec = selector_spec(get_preset(TINY)["model"], sites, global_class=False)
    network = super_model_network(get_preset(TINY)["model"], sites, spec)
    for name, net in (("global", nets["global"]), ("person_0", nets["p0"]), ("person_1", nets["p1"])):
        network[name].load_state_dict(net.state_dict())
    with torch.no_grad():  # site index 1: zero precision, so every case is at distance 0 (typicality 1); index 0 unset
        network["select"].present[1] = 1.0
    save_super_model(path, network, super_model_description(TINY, None, sites, spec, softpull_lambda=0.7, gamma=0.5), {"round": 1})
    return path, nets


def test_evaluate_a_super_model_routes_by_gamma(tmp_path, capsys):
    sm, nets = _super_model(tmp_path / "sm.pt")
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(sm), "--site", "site-1", "--gamma", "1,0.5", "--out", str(out)]) == 0
    always_global, routed, global_model = json.loads(out.read_text())["evaluations"]
    test = load_site("site-1", get_preset(TINY)["data"]).test
    site = "site-1"
    assert always_global["sites"][site]["report"]["global model"] == 1.0
    direct_global = _direct(nets["global"], test)["mean"]["dice"]
    assert always_global["sites"][site]["mean"]["dice"] == pytest.approx(direct_global)
    assert routed["sites"][site]["report"] == {"global model": 0.0, "site-1": 0.0, "site-2": 1.0}
    assert routed["sites"][site]["mean"]["dice"] == pytest.approx(_direct(nets["p1"], test)["mean"]["dice"])
    # the super model's own global model is scored beside it (the README's promise), in one table, in percent
    assert global_model["label"] == "global model" and "report" not in global_model["sites"][site]
    assert global_model["sites"][site]["mean"]["dice"] == pytest.approx(direct_global)
    printed = capsys.readouterr().out
    side = printed[printed.index("== side by side"):].splitlines()
    assert side[1] == ("| test site | cases | global model: dice (%) | super model, gamma 1.0: dice (%) | "
                       "super model, gamma 0.5: dice (%) |")
    assert side[3].split(" | ")[2] == f"{100 * direct_global:.2f}"
    assert "| test site | global model (%) | site-1 (%) | site-2 (%) |" in printed
    assert "'global model': the FedAvg global model" in printed and "GM" not in printed


def test_kind_options_are_checked(tmp_path, capsys):
    sm, _ = _super_model(tmp_path / "sm.pt")
    assert main(["evaluate", "--model", str(sm), "--site", "site-1", "--gamma", "1.5"]) == 2
    assert "gamma" in capsys.readouterr().err
    ckpt, _ = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--gamma", "0.9"]) == 2
    assert "fedsm_super_model" in capsys.readouterr().err
    assert main(["show", "--model", str(sm)]) == 0
    printed = capsys.readouterr().out
    assert "fedsm_super_model" in printed and "personalised (site-2)" in printed and "--gamma" in printed
