"""What the FedSM server and sites exchange: task names, payload keys, DXO parts and task-meta keys, spelled once.

Server -> site (task data, one WEIGHTS DXO of flat arrays): the global model, this site's personalised model
and the selector under the prefixes :data:`GLOBAL`, :data:`PERSON`, :data:`SELECT`; in FedSM-extra rounds and
in the final ``validate`` task every site's personalised model instead, under :func:`person_key` ``(i)``.
The super model's container network (:mod:`.supermodel`) uses the same names for its submodules, so a flat
super-model state and a payload share their keys.

Site -> server (task result, a COLLECTION DXO of parts, each with its own data kind so a site's privacy
scope sees each part; see jobs/fedsm/README.md for what each one holds):

============================  ===============  =====================================================
part                          data kind        content
============================  ===============  =====================================================
:data:`WEIGHTS_PART`          WEIGHT_DIFF      ``global.*`` and ``person.*`` updates (main rounds)
:data:`STATS_PART`            STATISTICS       the selector's feature Gaussian of this site (main)
:data:`HEAD_PART`             WEIGHT_DIFF      the FedSM-extra head's gradient step (extra rounds)
:data:`METRICS_PART`          METRICS          the final super model's scores (``validate``)
============================  ===============  =====================================================

The ``validate`` reply holds no weights, only a METRICS part. Every reply also holds the validation scores as a
METRICS part named ``initial_metrics``, which the server's intake (:mod:`medflare.common.egress`) puts in the
result's meta, where a stock ``IntimeModelSelector`` reads them to pick the best super model. :func:`manifest`
declares all of it for the sites' check and ``medflare audit``.
"""

from nvflare.apis.dxo import MetaKey

from medflare.common.egress import Send, declare

# ---- tasks ------------------------------------------------------------------------------------
TASK_TRAIN = "train"  # main and extra rounds (Algorithm 1 / FedSM-extra)
TASK_VALIDATE = "validate"  # score the final super model; trains nothing
TASKS = (TASK_TRAIN, TASK_VALIDATE)

# ---- model names: payload prefixes and the super model's submodules ---------------------------
GLOBAL = "global"
PERSON = "person"  # this site's own personalised model in a main-round payload
SELECT = "select"


def person_key(index: int) -> str:
    """Name of site ``index``'s personalised model in the super model and in an all-models payload."""
    return f"{PERSON}_{index}"


# ---- parts of a site's COLLECTION reply -----------------------------------------------------
WEIGHTS_PART = "weights"
STATS_PART = "feature_stats"
HEAD_PART = "selector_head"
METRICS_PART = "metrics"  # the validate reply's only part

#: keys of the STATISTICS part (flat numpy arrays; see :func:`medflare.fedsm.density.site_gaussian`)
STAT_KEYS = ("n", "mean", "cov", "val_n", "val_d2_mean", "val_d2_var")

# ---- task meta: configuration, never data ---------------------------------------------------
SITES = "fedsm_sites"  # [site names]; a site's selector index is its position here (Eq. 2)
SELECTOR = "fedsm_selector"  # {"name", "args"} of the selector network
PHASE = "fedsm_phase"  # MAIN | EXTRA
GAMMA = "fedsm_gamma"  # routing threshold of the scores a site reports

MAIN = "main"  # Algorithm 1: global + personalised models trained, selector Gaussians refreshed
EXTRA = "extra"  # FedSM-extra: only the selector head is trained (Eq. 1 labels)
PHASES = (MAIN, EXTRA)


def manifest() -> dict:
    """What a FedSM site sends per task (the table above)."""
    scores = Send(MetaKey.INITIAL_METRICS, "METRICS", "validation scores of the received super model (numbers)")
    return declare({
        TASK_TRAIN: [Send(WEIGHTS_PART, "WEIGHT_DIFF", "updates of the global and the site's personalised model (main rounds)",
                          models=2),
                     Send(STATS_PART, "STATISTICS", "the selector's feature Gaussian of the site: mean, covariance, counts"),
                     Send(HEAD_PART, "WEIGHT_DIFF", "one gradient step of the selector head (FedSM-extra rounds)", models=1),
                     scores],
        TASK_VALIDATE: [Send(METRICS_PART, "METRICS", "the final super model's scores", cadence="last round"),
                        Send(MetaKey.INITIAL_METRICS, "METRICS", scores.what, cadence="last round")],
    })
