"""`medflare evaluate` and `medflare baseline` on tiny data: results, and one-line errors for bad input."""

import json

import torch

from medflare.cli import main
from medflare.common.persistence import describe, model_from_preset


def _checkpoint(path, preset="seg_synthetic_tiny"):
    model = model_from_preset(preset)
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(preset)}}, path)
    return path


def test_evaluate_a_saved_model_on_a_site_and_a_datalist(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert 0.0 <= result["mean"]["dice"] <= 1.0 and len(result["per_case"]) > 0
    assert "mean: dice=" in capsys.readouterr().out

    assert main(["data", "--preset", "seg_synthetic_tiny", "-n", "1", "--out", str(tmp_path / "d")]) == 0
    datalist = tmp_path / "d" / "site-1.json"
    assert main(["evaluate", "--model", str(ckpt), "--datalist", str(datalist), "--split", "validation"]) == 0


def test_evaluate_errors_name_the_file(tmp_path, capsys):
    assert main(["evaluate", "--model", str(tmp_path / "missing.pt"), "--site", "site-1"]) == 2
    assert "missing.pt" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main(["evaluate", "--model", str(tmp_path / "junk.pt"), "--site", "site-1"]) == 2
    assert "junk.pt" in capsys.readouterr().err
    torch.save(model_from_preset("seg_synthetic_tiny").state_dict(), tmp_path / "plain.pt")
    assert main(["evaluate", "--model", str(tmp_path / "plain.pt"), "--site", "site-1"]) == 2
    assert "--preset" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "plain.pt"), "--site", "site-1", "--preset", "seg_synthetic_tiny"]) == 0
    ckpt = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "--datalist", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_local_and_central_baselines_learn(tmp_path):
    out = tmp_path / "central.json"
    args = ["baseline", "--preset", "seg_synthetic_tiny", "--sites", "site-1,site-3", "--epochs", "8", "--device", "cpu"]
    assert main(args + ["--mode", "central", "--out", str(out)]) == 0
    central = json.loads(out.read_text())
    assert central["curve"][-1] > central["curve"][0] + 0.2, central["curve"]
    assert central["client_average"]["dice"] > 0.5
    assert set(central["sites"]) == {"site-1", "site-3"}
    assert main(args + ["--mode", "local", "--out", str(out)]) == 0
    local = json.loads(out.read_text())
    assert local["mode"] == "local" and local["client_average"]["dice"] > 0.3


def _super_model(path, sites=("site-1", "site-2")):
    from medflare.common.payload import state_to_numpy
    from medflare.fedsm.selector import build_selector
    from medflare.fedsm.supermodel import save_super_model

    torch.manual_seed(0)
    net = state_to_numpy(model_from_preset("seg_synthetic_tiny"))
    spec = {"name": "style_selector", "args": {"in_channels": 1, "num_classes": len(sites), "width": 4, "depth": 2}}
    save_super_model(
        path, description=describe("seg_synthetic_tiny", kind="super_model"), sites=list(sites), selector_spec=spec,
        global_class=False, global_params=net, person_params={s: net for s in sites},
        selector_params=state_to_numpy(build_selector(spec)), lam=0.7, round_num=1, gamma=0.5,
    )
    return path


def test_evaluate_a_super_model_on_sites_with_a_gamma_sweep(tmp_path, capsys):
    sm = _super_model(tmp_path / "sm.pt")
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(sm), "--sites", "site-1,site-2", "--gamma", "0,1", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["gamma_sweep"]
    always_global, always_person = sweep["1.0"], sweep["0.0"]
    for site in ("site-1", "site-2"):
        assert always_global["per_site"][site]["selection"]["GM"] == 1.0
        assert always_person["per_site"][site]["selection"]["GM"] == 0.0
    assert 0 <= always_global["client_average"]["dice"] <= 1 and "global" in always_global
    printed = capsys.readouterr().out
    assert "| test site | GM | site-1 | site-2 |" in printed and "client avg" in printed

    # one site, the job's gamma from the file (0.5), per-case lines
    assert main(["evaluate", "--model", str(sm), "--site", "site-1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gamma"] == 0.5 and result["per_case"] and set(result["selection"]) == {"GM", "site-1", "site-2"}


def test_evaluate_super_model_errors(tmp_path, capsys):
    sm = _super_model(tmp_path / "sm.pt")
    assert main(["evaluate", "--model", str(sm), "--site", "site-1", "--gamma", "1.5"]) == 2
    assert "--gamma" in capsys.readouterr().err
    ckpt = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--gamma", "0.9"]) == 2
    assert "not a FedSM super model" in capsys.readouterr().err


def test_evaluate_a_single_model_on_several_sites(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "m.pt")
    assert main(["evaluate", "--model", str(ckpt), "-n", "2", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["per_site"]) == {"site-1", "site-2"} and "client_average" in result


def test_evaluate_a_classifier_on_an_npz(tmp_path):
    ckpt = _checkpoint(tmp_path / "c.pt", preset="cls_synthetic_tiny")
    assert main(["data", "--preset", "cls_synthetic_tiny", "-n", "10", "--out", str(tmp_path / "d")]) == 0
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(ckpt), "--npz", str(tmp_path / "d" / "site-1.npz"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert 0.0 <= result["mean"]["accuracy"] <= 1.0 and len(result["per_case"]) > 0
    assert main(["evaluate", "--model", str(ckpt), "--npz", str(tmp_path / "missing.npz")]) == 2
