"""One way to set every knob (issue 30): typed settings sections, registered with the presets by plain data.

Every key of every registered section can be set through a preset's overrides (what a job folder's ``overrides`` and
``medflare run --set`` pass), even where the preset does not list the key; an unknown key is refused naming the section
and its valid keys; a bad value is refused naming ``<section>.<key>``; every knob a job README's tables name is a key of
a section and settable; each job's components resolve one preset (checked at START_RUN).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest

from medflare import ConfigError
from medflare.presets import PRESETS, get_preset, overrides_from_assignments
from medflare.settings import (SECTIONS, Bool, Check, Int, Items, Nested, NetSpec, Number, OneOf, OrNone, Section, Text,
                               section, section_class, setting)

REPO = Path(__file__).resolve().parents[2]
#: a preset that holds each section (any preset takes an algorithm's section through overrides; these hold it already)
HOLDER = {"train": "seg_synthetic_tiny", "eval": "seg_synthetic_tiny", "fedprox": "seg_synthetic_tiny",
          "fedsm": "seg_synthetic_tiny", "fedvck": "fedvck_synthetic_tiny", "fediod": "fediod_cls_tiny", "fedst": "fedst_tiny",
          "diffusion": "fedst_tiny"}
#: the sections whose every key each job's README tables list (the other jobs' READMEs refer to these for the rest:
#: scaffold to fedavg, fediod_seg to fediod, fedst_join to fedst_separate)
JOB_SECTIONS = {"fedavg": ("train", "eval"), "fedprox": ("fedprox",), "fedsm": ("fedsm",), "fedvck": ("fedvck",),
                "fediod": ("fediod",), "fedst_separate": ("fedst", "diffusion"), "fedst_join": (), "fediod_seg": (),
                "scaffold": ()}


# ---- the mechanism ---------------------------------------------------------------------------------------------------
@section("demo.inner")
class Inner(Section):
    """Keys: k."""

    k: int = setting(1, Int(0))


def _odd(key, value):
    if not isinstance(value, int) or value % 2 == 0:
        raise ConfigError(f"'{key}' must be odd, got {value!r}")
    return value


@section("demo")
class Demo(Section):
    """A section for the tests. Keys: n, x, mode, flag, name, maybe, sizes, net, inner, odd."""

    n: int = setting(3, Int(1))
    x: float = setting(0.5, Number(0.0, 1.0, low_open=True))
    mode: str = setting("a", OneOf(("a", "b")))
    flag: bool = setting(True, Bool())
    name: str = setting("d", Text(empty=False))
    maybe: int | None = setting(None, OrNone(Int(0)))
    sizes: list = setting([1, 2], Items(Int(1), min_items=1))
    net: dict = setting({"name": "unet", "args": {}}, NetSpec(("unet",)))
    inner: dict = setting({}, Nested(Inner))
    odd: int = setting(1, Check(_odd))


@section("demo.required")
class Required(Section):
    """Keys: must (required), may."""

    must: int = setting(rule=Int(0))
    may: int = setting(2, Int(0))


def test_a_section_fills_defaults_and_gives_its_values_back():
    d = Demo.from_dict({"n": 5})
    assert d.n == 5 and d.x == 0.5 and d.inner == {"k": 1} and d.net == {"name": "unet", "args": {}}
    assert Demo.from_dict(d.as_dict()) == d and Demo.from_dict(None) == Demo()
    assert d.replace(mode="b").mode == "b" and d.mode == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.n = 7  # type: ignore[misc]
    a, b = Demo(), Demo()
    a.sizes.append(9)
    assert b.sizes == [1, 2]  # mutable defaults are copies


def test_an_unknown_key_names_the_section_and_lists_the_valid_keys():
    with pytest.raises(ConfigError, match=r"\['demo\.bogus'\] in section 'demo' \(valid keys: n, x, mode, flag, name, maybe, "
                                          r"sizes, net, inner, odd\)"):
        Demo.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=r"'demo\.inner\.j'.*valid keys: k"):
        Demo.from_dict({"inner": {"j": 1}})
    with pytest.raises(ConfigError, match=r"lacks required key\(s\) \['demo\.required\.must'\]"):
        Required.from_dict({"may": 1})
    with pytest.raises(ConfigError, match="must be a dict"):
        Demo.from_dict([1])


@pytest.mark.parametrize("key, value, message", [
    ("n", 0, "a positive int"), ("n", True, "a positive int"), ("n", 1.5, "a positive int"),
    ("x", 0, r"in \(0, 1\]"), ("x", 1.5, r"in \(0, 1\]"), ("x", float("nan"), "finite"), ("x", "0.5", "finite"),
    ("mode", "c", r"one of \['a', 'b'\]"), ("flag", "yes", "true or false"), ("name", "", "non-empty string"),
    ("maybe", -1, "an int >= 0"), ("sizes", [], "at least 1"), ("sizes", [1, 0], r"demo\.sizes\[1\]"),
    ("net", {"name": "vgg"}, r"demo\.net\.name"), ("net", {"name": "unet", "width": 3}, "'name'"),
    ("inner", {"k": -1}, r"demo\.inner\.k"), ("odd", 2, "must be odd"),
])
def test_each_rule_refuses_a_bad_value_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        Demo.from_dict({key: value})
    assert f"demo.{key}" in str(err.value) and re.search(message, str(err.value)), str(err.value)


# ---- the registry and the presets ------------------------------------------------------------------------------------
def test_every_registered_section_loads_and_documents_every_key():
    """The registry is data ("module:Class"); each class is a Section named as registered; its docstring (or its
    module's) names every key, and every default passes its own rules."""
    for name in SECTIONS:
        cls = section_class(name)
        assert issubclass(cls, Section) and cls.SECTION == name, name
        doc = (cls.__doc__ or "") + (sys.modules[cls.__module__].__doc__ or "")
        undocumented = [k for k in cls.keys() if not re.search(rf"\b{k}\b", doc)]
        assert not undocumented, f"{cls.__name__}'s docstring lacks {undocumented}"
    with pytest.raises(ConfigError, match="unknown settings section 'nope'"):
        section_class("nope")


def test_presets_import_no_algorithm():
    """Reading a preset without an algorithm's section imports none of its modules (the sections load lazily)."""
    import subprocess

    code = ("import sys; from medflare.presets import get_preset; get_preset('seg_synthetic'); "
            "print(sorted(m for m in sys.modules if m.startswith('medflare.') and m.split('.')[1] in "
            "('fedsm', 'fedvck', 'fediod', 'fedst', 'baselines')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _current(name: str) -> dict:
    cfg = get_preset(HOLDER[name])
    return section_class(name).from_preset(cfg).as_dict()


def _other_value(rule, value):
    """A valid value of ``rule`` different from ``value`` where one is easy to name, else ``value``."""
    if isinstance(rule, OneOf):
        return next((c for c in rule.choices if c != value), value)
    if isinstance(rule, Bool):
        return not value
    if isinstance(rule, Int):
        return value + 1
    if isinstance(rule, OrNone) and value is None and isinstance(rule.rule, Int):
        return rule.rule.low + 1
    if isinstance(rule, Number):
        return value / 2 if value and rule.low <= value / 2 and not (rule.low_open and value / 2 == rule.low) else value
    return value


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_key_of_every_section_is_settable_through_overrides(name):
    """Each key, set alone through overrides (as a job folder's ``overrides`` or ``medflare run --set`` does), on a preset
    that holds the section and on one that does not, comes back from get_preset and from the typed section."""
    cls = section_class(name)
    rules = {f.name: f.metadata["rule"] for f in dataclasses.fields(cls)}
    current = _current(name)
    for key in cls.keys():
        value = _other_value(rules[key], current[key])
        for preset in {HOLDER[name], "seg_synthetic_tiny" if name not in ("train", "eval") else HOLDER[name]}:
            cfg = get_preset(preset, {name: {key: copy.deepcopy(value)}})
            assert cfg[name][key] == value, (name, key, preset)
            assert getattr(cls.from_preset(cfg), key) == rules[key](f"{name}.{key}", value)


@pytest.mark.parametrize("name", list(SECTIONS))
def test_an_unknown_key_of_a_section_is_refused_naming_it_and_the_valid_keys(name):
    keys = section_class(name).keys()
    with pytest.raises(ConfigError, match=re.escape(f"['{name}.no_such_key'] in section '{name}' (valid keys: {', '.join(keys)})")):
        get_preset(HOLDER[name], {name: {"no_such_key": 1}})


def _bad_value(rule, value):
    """A value ``rule`` refuses: the wrong JSON type for the current value."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, str):
        return 12345
    return "not-a-number" if not isinstance(value, (list, dict)) else 7


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_bad_value_of_every_key_is_refused_naming_the_key(name):
    cls = section_class(name)
    rules = {f.name: f.metadata["rule"] for f in dataclasses.fields(cls)}
    current = _current(name)
    for key in cls.keys():
        with pytest.raises(ConfigError, match=re.escape(f"{name}.{key}")):
            get_preset(HOLDER[name], {name: {key: _bad_value(rules[key], current[key])}})
        low = rules[key].low if isinstance(rules[key], (Int, Number)) else None
        if low is not None and math.isfinite(low):  # out of range too, not only the wrong type
            with pytest.raises(ConfigError, match=re.escape(f"'{name}.{key}' must be")):
                get_preset(HOLDER[name], {name: {key: low - 1}})


def test_the_sections_cross_key_checks():
    with pytest.raises(ConfigError, match="'diffusion.sample_steps' .* cannot exceed 'diffusion.train_timesteps'"):
        get_preset("fedst_tiny", {"diffusion": {"train_timesteps": 5}})
    with pytest.raises(ConfigError, match="attention_levels"):
        get_preset("fedst_tiny", {"diffusion": {"generator": {"channels": [8, 16]}}})
    with pytest.raises(ConfigError, match="beta_start"):
        get_preset("fedst_tiny", {"diffusion": {"beta_start": 0.5}})


def test_the_issue_s_refused_knobs_are_accepted_and_reach_the_typed_sections():
    """Issue 30 listed these as refused by get_preset ("unknown config key"): each now resolves."""
    from medflare.fedst.config import DiffusionConfig
    from medflare.fediod.config import FedIODConfig

    fediod = {"ensemble": "mean", "lambda_bn": 2.0, "gan_weighting": "uniform", "label_source": "site-9", "image_size": 32,
              "tau": 2.0, "cosine": False}
    assert FedIODConfig.from_preset(get_preset("fediod_cls", {"fediod": fediod})).as_dict().items() >= fediod.items()
    diffusion = {"loss": "l1", "beta_start": 2e-4, "beta_end": 1e-2, "beta_schedule": "scaled_linear_beta"}
    assert DiffusionConfig.from_preset(get_preset("fedst", {"diffusion": diffusion})).as_dict().items() >= diffusion.items()
    # and from `medflare run --set` assignments
    sets = overrides_from_assignments(["fediod.ensemble=mean", "diffusion.loss=l1", "fedsm.gamma=0.2", "fedprox.mu=0.1"])
    cfg = get_preset("seg_synthetic_tiny", {k: v for k, v in sets.items() if k not in ("fediod", "diffusion")})
    assert cfg["fedsm"] == {"gamma": 0.2} and cfg["fedprox"] == {"mu": 0.1}
    # data and model keep their rule: only the keys the preset lists (their keys depend on the data kind and network)
    with pytest.raises(ConfigError, match="unknown config key 'data.nope'"):
        get_preset("seg_synthetic_tiny", {"data": {"nope": 1}})
    with pytest.raises(ConfigError, match=r"unknown config key 'nope' \(known: .*'fediod'"):
        get_preset("seg_synthetic_tiny", {"nope": {}})


def test_every_shipped_preset_holds_valid_sections_and_no_preset_is_changed_by_reading_it():
    before = copy.deepcopy(PRESETS)
    for name in PRESETS:
        cfg = get_preset(name)
        for sec in SECTIONS:
            if sec in cfg:
                section_class(sec).from_preset(cfg)
    assert PRESETS == before


# ---- the job READMEs' knob tables ------------------------------------------------------------------------------------
def _readme_knobs(job: str) -> set[str]:
    """``section.key`` in the first cell of any table row of jobs/<job>/README.md (backticks allowed)."""
    out = set()
    for line in (REPO / "jobs" / job / "README.md").read_text().splitlines():
        cell = line.split("|")[1].strip().strip("`") if line.startswith("|") and line.count("|") > 2 else ""
        for knob in re.split(r"[,\s]+", cell.replace("`", "")):
            if "." in knob and knob.split(".")[0] in SECTIONS:
                out.add(knob)
    return out


@pytest.mark.parametrize("job", list(JOB_SECTIONS))
def test_every_knob_in_a_job_readme_is_a_key_of_its_section_and_settable(job):
    """Walks the README's tables: each ``section.key`` is a key of a registered section and get_preset takes it on the
    job's preset; and each key of the job's sections is in its tables (the tables are the knob list a user reads)."""
    knobs = _readme_knobs(job)
    preset = next(c.args["preset"] for c in _job_components(job) if "preset" in c.args)
    for knob in sorted(knobs):
        name, key = knob.split(".", 1)
        top = key.split(".")[0]
        assert top in section_class(name).keys(), f"jobs/{job}/README.md names '{knob}', not a key of section '{name}'"
        value = section_class(name).from_preset(get_preset(preset)).as_dict()[top]
        assert get_preset(preset, {name: {top: value}})[name][top] == value
    for name in JOB_SECTIONS[job]:
        missing = [k for k in section_class(name).keys() if f"{name}.{k}" not in knobs]
        assert not missing, f"jobs/{job}/README.md's knob tables lack {[f'{name}.{k}' for k in missing]}"


def test_every_job_readme_is_walked():
    from medflare.recipes import RECIPES

    assert set(JOB_SECTIONS) == set(RECIPES)


class _Comp:
    def __init__(self, entry):
        self.path, self.args = entry.get("path", ""), entry.get("args") or {}


def _job_components(job: str) -> list[_Comp]:
    from medflare.common.preset_check import components

    out = []
    for path in sorted((REPO / "jobs" / job / "app" / "config").glob("config_fed_*.json")):
        out += [_Comp(c) for c in components(json.loads(path.read_text()), filters=True)]
    return out


# ---- one preset per job ----------------------------------------------------------------------------------------------
def test_every_shipped_job_resolves_one_preset_and_a_changed_component_is_named(tmp_path):
    from medflare.common.preset_check import check_app_folder, preset_differences
    from medflare.recipes import RECIPES

    for job in RECIPES:
        configs = {p.name: json.loads(p.read_text()) for p in (REPO / "jobs" / job / "app" / "config").glob("config_fed_*.json")}
        assert preset_differences(configs) == [], job
        assert any(c.get("path") == "medflare.common.preset_check.PresetCheck" for c in configs["config_fed_server.json"]["components"])
        assert any(c.get("path") == "medflare.common.preset_check.PresetCheck" for c in configs["config_fed_client.json"]["components"])
    folder = tmp_path / "config"
    folder.mkdir()
    for p in (REPO / "jobs" / "fedst_join" / "app" / "config").glob("config_fed_*.json"):
        config = json.loads(p.read_text())
        if p.name == "config_fed_client.json":
            sampler = next(e["executor"] for e in config["executors"] if e["executor"]["path"].endswith("StyleSamplingExecutor"))
            sampler["args"]["overrides"] = {"diffusion": {"sample_steps": 5}}
            sampler["args"]["seed"] = 3
        (folder / p.name).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"component 'StyleSamplingExecutor' \(medflare\.fedst\.executor\.StyleSamplingExecutor, "
                                          r"config_fed_client\.json\) has overrides \{\"diffusion\": \{\"sample_steps\": 5\}\} "
                                          r"where 'fedst_join' .* has \{\}.*has seed 3 where 'fedst_join'"):
        check_app_folder(folder)


# ---- the algorithms read their sections ------------------------------------------------------------------------------
def test_fedsm_settings_are_a_section_with_the_job_s_former_values():
    from medflare.fedsm.config import FedSMConfig
    from medflare.fedsm.controller import FedSMController

    assert FedSMConfig().as_dict() == {"softpull_lambda": 0.7, "gamma": 0.05, "gamma_from_validation": True, "selector": {},
                                       "extra_rounds": 0, "head_lr": 0.05}
    ctrl = FedSMController(preset="seg_synthetic_tiny", overrides={"fedsm": {"gamma": 0.2, "extra_rounds": 2,
                                                                             "selector": {"levels": 1}}})
    assert (ctrl.gamma, ctrl.extra_rounds, ctrl.selector, ctrl.softpull_lambda) == (0.2, 2, {"levels": 1}, 0.7)


def _workflow_args(recipe, tmp_path) -> dict:
    """The server workflow's arguments in the recipe's exported job folder."""
    recipe.export(str(tmp_path))
    server = next(tmp_path.glob("*/app/config/config_fed_server.json"))
    return json.loads(server.read_text())["workflows"][0]["args"]


def test_fedst_rounds_are_honoured_by_the_recipe_and_a_disagreeing_job_folder_is_refused(tmp_path):
    from medflare.fedst.controller import FedSTJoinController, FedSTSeparateController
    from medflare.fedst.recipe import FedSTJoinRecipe

    overrides = {"fedst": {"rounds": 5, "cds_lambda": 0.5}}
    assert _workflow_args(FedSTJoinRecipe(preset="fedst_tiny", overrides=overrides), tmp_path)["num_rounds"] == 5
    ctrl = FedSTJoinController(num_rounds=5, preset="fedst_tiny", overrides=overrides)
    assert (ctrl.num_rounds, ctrl.lam, ctrl.refresh_every) == (5, 0.5, 2)
    assert FedSTSeparateController(num_rounds=3, preset="fedst_tiny").refresh_every == 0  # null: the variant's default
    # a job folder whose overrides set fedst.rounds but whose workflow runs other num_rounds: refused, not ignored
    with pytest.raises(ConfigError, match=r"'fedst\.rounds' 20 but the workflow's 'num_rounds' is 8"):
        FedSTJoinController(num_rounds=8, preset="fedst", overrides={"fedst": {"rounds": 20}})


def test_fedprox_mu_is_a_section_the_recipe_sends_and_other_baselines_refuse(tmp_path):
    from medflare.baselines.executor import SupervisedExecutor
    from medflare.baselines.recipe import FedAvgRecipe, FedProxRecipe

    assert _workflow_args(FedProxRecipe(preset="seg_synthetic_tiny"), tmp_path / "a")["fedprox_mu"] == 0.01
    recipe = FedProxRecipe(preset="seg_synthetic_tiny", overrides={"fedprox": {"mu": 0.1}})
    assert _workflow_args(recipe, tmp_path / "b")["fedprox_mu"] == 0.1
    with pytest.raises(ConfigError, match="'fedprox' section, FedProx's; run the fedprox job"):
        FedAvgRecipe(preset="seg_synthetic_tiny", overrides={"fedprox": {"mu": 0.1}})
    # `medflare run fedprox -n 2 --set fedprox.mu=0.1`: the mu and the site count both reach the workflow (the run
    # command passes num_clients only to a recipe whose signature takes it)
    from medflare.jobs.run import build_recipe

    args = _workflow_args(build_recipe("fedprox", 2, preset="seg_synthetic_tiny", overrides={"fedprox": {"mu": 0.1}}), tmp_path / "c")
    assert (args["fedprox_mu"], args["num_clients"]) == (0.1, 2)
    # a site compares the mu its tasks carry with the job's overrides (it refuses a mismatch in its train task)
    assert SupervisedExecutor(preset="seg_synthetic_tiny", overrides={"fedprox": {"mu": 0.1}}).preset_mu == 0.1
    assert SupervisedExecutor(preset="seg_synthetic_tiny").preset_mu is None
