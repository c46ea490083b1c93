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
