"""The report's rows: for each method, the job that runs it, its presets (quick / full) and its saved result.

Every FL row is one of the shipped jobs (exported from its recipe, :data:`medflare.recipes.RECIPES`) run in the
FLARE simulator with the row's preset, sites and rounds; local and centralised rows are
:func:`medflare.baselines.standalone.run_standalone` with as many passes over the data as the FL rows have
rounds x local epochs. Within a task every row uses the same synthetic sites (or the user's sites through
``MEDFLARE_DATA``), the same image size and the same label skew; the presets differ only in what their
algorithm needs (FedIOD's generator, FedST's diffusion model, FedVCK's condensation budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medflare import ConfigError

TASKS = ("seg", "cls")
#: what every row is scored with on the test splits (the tables' columns)
SCORE_METRICS = {"seg": ["dice", "hd95"], "cls": ["accuracy"]}
MODES = ("quick", "full")


@dataclass(frozen=True)
class Method:
    """One row. ``job`` None = standalone (``mode`` local / central). ``presets`` per mode; ``result`` the file the
    job saves in the server's app folder; ``curve`` the TensorBoard tag (``{key}`` = the preset's key metric) whose
    mean over sites per round is the learning curve, read from the sites' folders unless ``curve_on_server``;
    ``curve_start``: the completed rounds its first point reflects (0: sites score the model they receive at a
    round's start, so the first point is the initial model; 1: the value is taken after the round's update);
    ``overrides``: the row's algorithm settings (preset sections, e.g. ``{"fedsm": {"extra_rounds": 1}}``);
    ``site_steps`` / ``server_steps``: the TensorBoard tags holding the optimisation steps a round spent at each site
    and at the server (:mod:`medflare.report.compute`): ``()`` = no optimisation there, None = it trains there
    but streams no steps; ``server_time``: the tag of the server's training seconds per round, where streamed;
    ``rounds_scale``: per mode, the row's rounds as a multiple of the report's (1 where absent): the job's own schedule
    where it differs from the baselines' (FedSM's one local epoch a round, twice the rounds for the same local epochs;
    FedIOD-seg's 600 server steps)."""

    name: str
    label: str
    task: str
    presets: dict[str, str]
    job: str | None = None
    result: str = ""
    curve: str = "val_global/{key}"
    curve_on_server: bool = False
    curve_start: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    workflow: dict[str, Any] = field(default_factory=dict)
    flare_clients_arg: bool = False  # FLARE's own FedAvg / Scaffold need num_clients
    site_steps: tuple[str, ...] | None = ("train/steps",)
    server_steps: tuple[str, ...] | None = ()
    server_time: str | None = None
    rounds_scale: dict[str, int] = field(default_factory=dict)

    @property
    def standalone(self) -> bool:
        return self.job is None


_SEG = {"quick": "seg_synthetic_tiny", "full": "seg_synthetic"}
#: FedSM's job preset: _SEG's sites and network with one local epoch a round (run at twice the rounds, rounds_scale)
_FEDSM = {"quick": "seg_synthetic_tiny", "full": "fedsm_synthetic"}
_CLS = {"quick": "cls_synthetic_tiny", "full": "cls_synthetic"}
#: the preset whose ``data`` block every row of a task reads (an algorithm's own preset may differ in its pool size
#: or skew, e.g. FedIOD's smaller pool for its 15-minute default job; the report overrides that, see :func:`task_data`)
TASK_DATA = {"seg": _SEG, "cls": _CLS}
#: steps on the record that are not the sites' ``train/steps``: FedVCK's sites condense (image steps) and its server
#: trains the model on the condensed sets; FedIOD's server trains the generator and the student (its sites' teachers
#: train once, in stage 1, and stream no steps)
_FEDVCK_SITE, _FEDVCK_SERVER = ("condense/steps",), ("train/steps",)
_FEDIOD_SERVER = ("train/steps_generator", "train/steps_student")
#: the rows ``--match-compute`` reruns at another row's step budget (short names)
BASELINES = ("fedavg", "fedprox", "scaffold")

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("fedavg", "FedAvg", "seg", _SEG, "fedavg", "FL_global_model.pt", flare_clients_arg=True),
    Method("fedprox", "FedProx", "seg", _SEG, "fedprox", "FL_global_model.pt", flare_clients_arg=True),
    Method("scaffold", "SCAFFOLD", "seg", _SEG, "scaffold", "FL_global_model.pt", flare_clients_arg=True),
    Method("fedsm", "FedSM", "seg", _FEDSM, "fedsm", "FedSM_super_model.pt", curve="val/own_or_global_{key}",
           rounds_scale={"full": 2}),
    Method("fedsm_extra", "FedSM-extra", "seg", _FEDSM, "fedsm", "FedSM_super_model.pt", curve="val/own_or_global_{key}",
           overrides={"fedsm": {"extra_rounds": 1}}, rounds_scale={"full": 2}),
    Method("fediod_seg", "FedIOD-seg", "seg", {"quick": "fediod_seg_tiny", "full": "fediod_seg"}, "fediod_seg",
           "FedIOD_student.pt", curve="student/val_{key}", site_steps=None, server_steps=_FEDIOD_SERVER,
           rounds_scale={"full": 3}),
    Method("fedst_separate", "FedST-separate", "seg", {"quick": "fedst_tiny", "full": "fedst"}, "fedst_separate",
           "FedST_style_store.pt"),
    Method("fedst_join", "FedST-join", "seg", {"quick": "fedst_tiny", "full": "fedst"}, "fedst_join", "FedST_join_generator.pt"),
    Method("local", "local only", "seg", _SEG),
    Method("central", "centralised", "seg", _SEG),
    Method("cls_fedavg", "FedAvg", "cls", _CLS, "fedavg", "FL_global_model.pt", flare_clients_arg=True),
    Method("cls_fedprox", "FedProx", "cls", _CLS, "fedprox", "FL_global_model.pt", flare_clients_arg=True),
    Method("cls_scaffold", "SCAFFOLD", "cls", _CLS, "scaffold", "FL_global_model.pt", flare_clients_arg=True),
    Method("fedvck", "FedVCK", "cls", {"quick": "fedvck_synthetic_tiny", "full": "fedvck_synthetic"}, "fedvck",
           "FedVCK_result.pt", curve="val_accuracy_pooled", curve_on_server=True,
           curve_start=1, site_steps=_FEDVCK_SITE, server_steps=_FEDVCK_SERVER, server_time="time/update_s"),
    Method("fediod", "FedIOD", "cls", {"quick": "fediod_cls_tiny", "full": "fediod_cls"}, "fediod", "FedIOD_student.pt",
           curve="student/val_{key}", site_steps=None, server_steps=_FEDIOD_SERVER),
    Method("cls_local", "local only", "cls", _CLS),
    Method("cls_central", "centralised", "cls", _CLS),
]}


def task_data(task: str, mode: str) -> dict[str, Any]:
    """The ``data`` block every row of ``task`` runs with in ``mode``: the same sites, images and skew for all."""
    from medflare.presets import get_preset

    return dict(get_preset(TASK_DATA[task][mode])["data"])


def method_mode(method: Method) -> str:
    """local / central for a standalone row."""
    return method.name.rsplit("_", 1)[-1]


def methods_for(task: str, names: list[str] | None = None) -> list[Method]:
    """The task's rows in table order; ``names`` (without the ``cls_`` prefix, e.g. fedavg,fedvck) selects some."""
    if task not in TASKS:
        raise ConfigError(f"unknown task '{task}' (known: {', '.join(TASKS)})")
    rows = [m for m in METHODS.values() if m.task == task]
    if not names:
        return rows
    short = {m.name.removeprefix("cls_"): m for m in rows}
    unknown = [n for n in names if n not in short and n not in {m.name for m in METHODS.values()}]
    if unknown:
        known = sorted({m.name.removeprefix("cls_") for m in METHODS.values()})
        raise ConfigError(f"unknown method(s) {unknown} (known: {', '.join(known)})")
    return [short[n] for n in names if n in short]
