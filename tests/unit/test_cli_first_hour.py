"""The first hour of a new user (issue 30): help that answers at once and mistakes that are never silent."""

import json
import os
import subprocess
import sys

import pytest

from medflare.cli import main

#: what building the parser must not import: the heavy libraries and any algorithm's code (its torch-free
#: ``options`` module, which declares the kind's command-line options, is allowed)
_HEAVY = ("torch", "monai")
_ALGORITHMS = ("medflare.baselines", "medflare.fedsm", "medflare.fedst", "medflare.fedvck", "medflare.fediod")

_PROBE = """
import contextlib, io, json, sys
from medflare.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("argv", [["--help"], ["evaluate", "--help"], ["predict", "--help"], ["sample", "--help"],
                                  ["show", "--help"], ["baseline", "--help"], ["presets"], ["--version"],
                                  ["run", "--help"], ["submit", "--help"], ["run", "fedavgg", "-n", "2"]])
def test_help_imports_no_torch_monai_or_algorithm(argv):
    """Every ``--help`` took 11-15 s: torch, MONAI and every algorithm were imported to build the parser."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [m for m in loaded if m.split(".")[0] in _HEAVY]
    algorithm = [m for m in loaded if m.startswith(_ALGORITHMS) and not m.endswith(".options") and m not in _ALGORITHMS]
    assert not heavy and not algorithm, (heavy[:5], algorithm)


def test_help_lists_every_command_and_has_text_for_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and all(f"{c} " in top for c in ("report", "audit", "presets", "evaluate"))
    from medflare.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices and "evaluate" in a.choices).choices
    bare = [(name, action.option_strings or action.dest) for name, sub in commands.items()
            for action in sub._actions if not action.help]
    assert not bare, bare


def test_kind_options_show_only_where_they_apply(capsys):
    """``sample --help`` showed FedSM's --gamma, ``evaluate --help`` FedST's --domain."""
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    evaluate = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    sample = capsys.readouterr().out
    assert "--gamma" in evaluate and "FedSM results" in evaluate and "--domain" not in evaluate
    assert "--domain" in sample and "FedST results" in sample and "--gamma" not in sample


def test_presets_one_line_each(capsys):
    from medflare.presets import PRESETS

    main(["presets"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    assert all(("segmentation" in line or "classification" in line) and "; for " in line for line in lines)


@pytest.mark.parametrize("argv", [["evaluate", "--model", "m.pt", "-n", "0"], ["data", "--out", "d", "-n", "0"],
                                  ["baseline", "--mode", "local", "-n", "-1"]])
def test_zero_sites_is_an_error(capsys, argv):
    """``medflare evaluate -n 0`` scored 4 sites (rc 0)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "argument -n" in capsys.readouterr().err


def _described(tmp_path, preset="seg_synthetic_tiny"):
    from medflare.common.results import describe, save_checkpoint

    path = tmp_path / "FL_global_model.pt"
    save_checkpoint({"model": {}, "train_conf": {"medflare": describe(preset)}}, path)
    return path


def test_a_preset_the_result_file_contradicts_is_an_error(tmp_path, capsys):
    """``--preset cls_synthetic`` on a segmentation model was ignored (rc 0)."""
    rc = main(["show", "--model", str(_described(tmp_path)), "--preset", "cls_synthetic"])
    err = capsys.readouterr().err
    assert rc == 2 and "'cls_synthetic'" in err and "'seg_synthetic_tiny'" in err, err


def test_show_on_a_text_file_says_it_is_not_a_result_file(tmp_path, capsys):
    """``show --model log.txt`` said "holds pickled code or objects (Unsupported operand 50)"."""
    log = tmp_path / "log.txt"
    log.write_text("2026-11-25 15:00:00 - INFO - round 1\n")
    rc = main(["show", "--model", str(log)])
    err = capsys.readouterr().err
    assert rc == 2 and "not a medflare result file" in err and "operand" not in err, err


def test_a_made_up_synthetic_site_is_named(monkeypatch):
    """``--sites site-1,site-9`` scored synthetic data made up for "site-9" without saying so."""
    from medflare.evaluation import made_up_site_notes
    from medflare.presets import get_preset

    monkeypatch.delenv("MEDFLARE_DATA", raising=False)
    data = get_preset("seg_synthetic_tiny")["data"]
    notes = made_up_site_notes(data, ["site-1", "site-9"], None)
    assert len(notes) == 1 and "'site-9'" in notes[0] and "made up" in notes[0]
    assert "training sites" in made_up_site_notes(data, ["site-3"], ["site-1", "site-2"])[0]
    monkeypatch.setenv("MEDFLARE_DATA", "/somewhere")
    assert made_up_site_notes(data, ["site-9"], None) == []


def test_declared_options_are_the_kinds_options():
    """The help shows the torch-free declarations; a loaded kind parses with the same objects."""
    from medflare.common.options import declared_options
    from medflare.common.results import kinds

    declared = declared_options()
    assert {name: k.options for name, k in kinds().items() if k.options} == {n: d.options for n, d in declared.items()}
