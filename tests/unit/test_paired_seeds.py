"""benchmarks/paired_seeds.py, the arithmetic behind RESULTS_report.md's paired intervals."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "paired_seeds.py"
_spec = importlib.util.spec_from_file_location("paired_seeds", _PATH)
paired_seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired_seeds)


def test_paired_differences_mean_interval_and_wins():
    """a - b = 1, 2, 3: mean 2, sample std 1, t(0.975, 2) = 4.3027 so the interval is 2 -+ 2.4842; a wins all three."""
    r = paired_seeds.paired([11.0, 22.0, 33.0], [10.0, 20.0, 30.0])
    assert r["diffs"] == [1.0, 2.0, 3.0] and r["mean"] == 2.0 and r["sd"] == 1.0 and r["wins"] == 3
    assert r["low"] == pytest.approx(2.0 - 2.4842, abs=1e-3) and r["high"] == pytest.approx(2.0 + 2.4842, abs=1e-3)
    assert r["p_wilcoxon"] == pytest.approx(0.25)  # the smallest two-sided p of three signed ranks


def test_paired_refuses_unpaired_lists_and_reads_named_values():
    with pytest.raises(SystemExit, match="equally long"):
        paired_seeds.paired([1.0, 2.0], [1.0, 2.0, 3.0])
    assert paired_seeds.parse("FedAvg=71.23,72.78") == ("FedAvg", [71.23, 72.78])
    with pytest.raises(SystemExit, match="NAME="):
        paired_seeds.parse("71.23,72.78")
