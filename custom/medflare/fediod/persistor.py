"""The FedIOD server's persistor: FLARE's PT file persistor holding the student and the generator as one model.

``FedIOD_student.pt`` (after every round) and ``best_FedIOD_student.pt`` (best mean validation at the sites)
are FLARE PT checkpoints: ``{"model": {"student.*", "generator.*"}, "train_conf": {"medflare": ...},
"meta_props": {...}}``. The ``medflare`` entry has kind ``fediod_student`` with the student's and the
generator's specs, so ``medflare evaluate`` scores the student and ``medflare sample`` runs the generator;
``meta_props`` holds the round, the sites, each site's (epsilon, delta) and stop reason, and the decision offset
folded into the student (:mod:`.calibration`; 0 without one).
"""

from __future__ import annotations

from typing import Any, Mapping

from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare.common.component import keep_args
from medflare.common.results import describe
from medflare.fediod.config import FedIODConfig
from medflare.fediod.networks import data_shape, server_networks, server_specs
from medflare.fediod.results import KIND
from medflare.presets import get_preset

STUDENT_FILE = "FedIOD_student.pt"
BEST_STUDENT_FILE = "best_FedIOD_student.pt"


def describe_student(preset: str, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``train_conf["medflare"]`` entry of a saved student + generator."""
    cfg = get_preset(preset, overrides)
    fcfg = FedIODConfig.from_preset(cfg)
    student, generator = server_specs(cfg, fcfg)
    return describe(preset, overrides, kind=KIND, version=1, model=student, generator=generator, task=data_shape(cfg, fcfg)[0])


class FedIODPersistor(PTFileModelPersistor):
    """``PTFileModelPersistor`` whose model is the preset's student + generator (initialised from ``seed``).

    Args:
        preset / overrides / seed: as the controller's (checked equal at START_RUN, medflare.common.preset_check). Defaults "fediod_cls", none, 0.
        global_model_file_name / best_global_model_file_name: file names in the server's app folder.
            Defaults "FedIOD_student.pt", "best_FedIOD_student.pt".
    """

    def __init__(self, preset: str = "fediod_cls", overrides: Mapping[str, Any] | None = None, seed: int = 0,
                 global_model_file_name: str = STUDENT_FILE, best_global_model_file_name: str = BEST_STUDENT_FILE):
        cfg = get_preset(preset, overrides)
        super().__init__(model=server_networks(cfg, FedIODConfig.from_preset(cfg), seed), global_model_file_name=global_model_file_name,
                         best_global_model_file_name=best_global_model_file_name)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed, global_model_file_name=global_model_file_name,
                  best_global_model_file_name=best_global_model_file_name)
        self.medflare_conf = describe_student(preset, overrides)

    def load_model(self, fl_ctx):
        learnable = super().load_model(fl_ctx)
        self.persistence_manager.train_conf = {**(self.persistence_manager.train_conf or {}), "medflare": self.medflare_conf}
        return learnable
