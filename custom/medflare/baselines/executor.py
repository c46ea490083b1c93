"""Client of the FedAvg, FedProx and SCAFFOLD jobs: validate the global model, train, return a weight diff."""

from __future__ import annotations

import time

from nvflare.apis.fl_constant import FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.app_common.app_constant import AlgorithmConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import ConfigError
from medflare.baselines.config import FedProxConfig
from medflare.baselines.corrections import ScaffoldState, fedprox_term
from medflare.baselines.protocol import TASK_TRAIN, TASK_VALIDATE, UPDATE
from medflare.common.component import keep_args
from medflare.common.egress import site_reply
from medflare.common.payload import check_finite, load_numpy_state, state_to_numpy, weight_diff
from medflare.common.update_guard import tree_norm
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.common.training import local_work, make_loss, make_optimizer, round_optimizer, train_epochs


class SupervisedExecutor(SiteExecutor):
    """Local supervised training for weight-averaging workflows (FLARE's FedAvg and Scaffold controllers).

    Each "train" task: load the received global model, score it on the site's validation split (reported
    to the server as the round's metrics and to TensorBoard), train ``train.epochs`` local epochs, and
    return the update as a WEIGHT_DIFF so that FLARE's privacy filters apply. The "validate" task (once, after the
    last round) only scores the received model, so that the best-model selector judges the final model too. The site's weight in the
    average is its number of training cases (FLMetaKey.NUM_STEPS_CURRENT_ROUND), as in FedAvg.

    The reply's parts (the job's manifest declares them): ``update`` (WEIGHT_DIFF), the scores as
    a METRICS part and, under SCAFFOLD, the control variate's change as a second WEIGHT_DIFF part, so a site's scope
    filters each (FLARE's own SCAFFOLD sends the controls in meta, where no filter sees them). The server's
    :class:`~medflare.common.egress.Intake` hands FLARE's FedAvg / Scaffold the shape they read.

    FedProx and SCAFFOLD are switched on by the server's task meta (see :mod:`.corrections`).
    Model, optimiser (its Adam moments included, unless ``train.optimizer_state`` is "fresh") and SCAFFOLD controls
    persist across rounds.

    Args: see :class:`medflare.common.site_executor.SiteExecutor`; ``train_task`` names the task. Default "train".
    """

    def __init__(self, *args, train_task: str = TASK_TRAIN, **kwargs):
        super().__init__(*args, **kwargs)
        keep_args(self, train_task=train_task)
        self.register_task(train_task, self.train)
        self.register_task(TASK_VALIDATE, self.validate_global)
        self.model = None
        self.optimizer = None
        self.scaffold: ScaffoldState | None = None
        # FedProx's mu as the job's overrides set it (None: they do not); the tasks' mu must then equal it
        self.preset_mu = FedProxConfig.from_preset(self.cfg).mu if "fedprox" in self.cfg else None

    def setup(self, fl_ctx: FLContext) -> None:
        train = self.cfg["train"]
        self.model = self.new_model()
        self.optimizer = make_optimizer(train["optimizer"], self.model.parameters(), train["lr"])
        self.loss_fn = make_loss(train["loss"], self.data.task)

    def _score_received(self, shareable: Shareable, fl_ctx: FLContext):
        """Load the received global model and score it on the validation split (TensorBoard, log); returns (its FLModel, round, scores)."""
        incoming = FLModelUtils.from_shareable(shareable)
        rnd = int(incoming.current_round or 0)
        load_numpy_state(self.model, incoming.params)
        metrics = self.validate(self.model, round_num=rnd, total_rounds=incoming.total_rounds)
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val_global/")
        self.log_overlays(fl_ctx, self.model, "val_global", rnd, incoming.total_rounds)
        self.log_info(fl_ctx, f"round {rnd}: global model on '{self.site}' validation: {format_metrics(metrics)}")
        return incoming, rnd, metrics

    def validate_global(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        """The "validate" task: the received (final) global model's scores, as the METRICS part a "train" reply lifts."""
        _, rnd, metrics = self._score_received(shareable, fl_ctx)
        return site_reply({}, lift={MetaKey.INITIAL_METRICS: DXO(DataKind.METRICS, data=dict(metrics))}, rnd=rnd)

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, rnd, metrics = self._score_received(shareable, fl_ctx)
        sent = state_to_numpy(self.model)

        train = self.cfg["train"]
        meta = incoming.meta or {}
        extra_loss = after_step = None
        mu = meta.get(AlgorithmConstants.FEDPROX_MU)
        if self.preset_mu is not None and float(mu or 0) != self.preset_mu:
            raise ConfigError(f"site '{self.site}': the job's overrides set fedprox.mu {self.preset_mu} but the server's "
                              f"workflow sends fedprox_mu {mu or 0} (FLARE's FedAvg argument, which the sites apply): set the "
                              "workflow's fedprox_mu to the same value")
        if mu:
            extra_loss = fedprox_term(self.model, float(mu))
        controls = meta.get(AlgorithmConstants.SCAFFOLD_CTRL_GLOBAL)
        if controls is not None:
            self.scaffold = self.scaffold or ScaffoldState(self.model)
            after_step = self.scaffold.begin_round(self.model, controls, train["lr"])
            self.tracker.scalars(fl_ctx, {"scaffold/correction_norm": self.scaffold.correction_norm()}, rnd)

        self.optimizer = round_optimizer(self.optimizer, self.model, train)
        tic = time.perf_counter()
        stats = train_epochs(
            self.model,
            self.loader("train", shuffle=True, round_num=rnd),
            self.loss_fn,
            self.optimizer,
            **local_work(train),
            device=self.torch_device,
            extra_loss=extra_loss,
            after_step=after_step,
            should_stop=lambda: abort_signal.triggered,
            amp=train["amp"],
        )
        train_s = time.perf_counter() - tic
        self.tracker.scalars(fl_ctx, {"train_loss": stats.mean_loss, "time/train_s": train_s}, rnd)
        self.log_steps(fl_ctx, rnd, stats.steps, f"mean loss {stats.mean_loss:.4f} (train {train_s:.2f} s)")

        diff = weight_diff(state_to_numpy(self.model), sent)
        check_finite(diff, self.site)
        self.tracker.scalars(fl_ctx, {"update_norm": tree_norm(diff)}, rnd)
        n = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}
        lift = {MetaKey.INITIAL_METRICS: DXO(DataKind.METRICS, data=dict(metrics))}
        if controls is not None:
            lift[AlgorithmConstants.SCAFFOLD_CTRL_DIFF] = DXO(DataKind.WEIGHT_DIFF, data=self.scaffold.end_round(self.model), meta=n)
        return site_reply({UPDATE: DXO(DataKind.WEIGHT_DIFF, data=diff, meta=n)}, lift=lift, unwrap=UPDATE, rnd=rnd)
