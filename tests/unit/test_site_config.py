"""A site's own medflare_site.json: sections, per-site overlays for one machine serving several sites, typos refused."""

import json

import pytest

from medflare import ConfigError
from medflare.common.site_config import SECTIONS, SITE_CONFIG, read_site_config, setting


def test_absent_file_gives_empty_sections(tmp_path):
    empty = {name: {} for name in SECTIONS}
    assert set(empty) >= {"privacy", "compute"}
    assert read_site_config(tmp_path, "site-1") == empty
    assert read_site_config(None, "site-1") == empty


def test_per_site_overlay_wins_for_that_site_only(tmp_path):
    (tmp_path / SITE_CONFIG).write_text(json.dumps({
        "privacy": {"noise": 0.1, "clip": 1.0}, "compute": {"threads": 2},
        "per_site": {"hospital-b": {"privacy": {"noise": 0.5}}},
    }))
    a, b = read_site_config(tmp_path, "hospital-a"), read_site_config(tmp_path, "hospital-b")
    assert a["privacy"] == {"noise": 0.1, "clip": 1.0} and b["privacy"] == {"noise": 0.5, "clip": 1.0}
    assert a["compute"] == b["compute"] == {"threads": 2}
    assert setting(b, "privacy", "noise", 0.0, check=lambda v: v >= 0) == 0.5
    assert setting(b, "privacy", "delta", 1e-5) == 1e-5
    with pytest.raises(ConfigError, match="privacy.noise"):
        setting(b, "privacy", "noise", 0.0, check=lambda v: v > 1, site="hospital-b")


@pytest.mark.parametrize("content, match", [
    ({"privcy": {}}, r"unknown section\(s\) \['privcy'\]"),
    ({"privacy": 3}, "section 'privacy'"),
    ({"per_site": {"site-1": {"compute": {}, "oops": {}}}}, "per_site.site-1"),
])
def test_bad_files_name_the_file_and_the_key(tmp_path, content, match):
    (tmp_path / SITE_CONFIG).write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=match) as err:
        read_site_config(tmp_path, "site-1")
    assert SITE_CONFIG in str(err.value)


def test_the_shipped_template_holds_every_algorithms_defaults(tmp_path):
    """app_configs' medflare_site.json.example, copied as is, is read by every algorithm and changes no default."""
    import pathlib
    import shutil

    from medflare.fediod.privacy import KEYS, PrivacySettings

    template = pathlib.Path(__file__).parents[2] / "app_configs" / "site" / "local" / "medflare_site.json.example"
    shutil.copy(template, tmp_path / SITE_CONFIG)
    config = read_site_config(tmp_path, "hospital-a")
    assert PrivacySettings.from_site_config(config, "hospital-a") == PrivacySettings()
    assert set(KEYS) <= set(config["privacy"])
    assert setting(config, "privacy", "fedsm_stats_noise", None) == 0.0
    from medflare.fedvck.executor import DEFAULT_MIN_CLASS_IMAGES, MIN_CLASS_IMAGES
    assert setting(config, "privacy", MIN_CLASS_IMAGES, None) == DEFAULT_MIN_CLASS_IMAGES
