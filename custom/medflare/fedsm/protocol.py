"""What the FedSM server and sites exchange besides the weights: task-meta keys.

Weights travel in the DXO data (FULL out, WEIGHT_DIFF back, prefixes ``global.``, ``person.``,
``select.``; in FedSM-extra rounds ``person_<i>.`` for every site), where FLARE's privacy filters see
them. The selector's feature statistics (:mod:`.calibrate`) are aggregate statistics, not weights: they
travel in the result's DXO meta under ``STATS`` (a filter that perturbs weight diffs must not perturb
them; the site's own ``stats_noise`` knob protects them instead).
"""

SITES = "fedsm_sites"  # [site names]; a site's selector label is its index here (Eq. 2)
SELECTOR = "fedsm_selector"  # {"name", "args"} of the selector network
GLOBAL_CLASS = "fedsm_global_class"  # selector column 0 is the global model (FedSM-extra)
PHASE = "fedsm_phase"  # "main" (Algorithm 1) | "extra" (selector only, Eq. 1 labels)
GAMMA = "fedsm_gamma"  # routing threshold for the super-model Dice reported each round
STATS = "fedsm_stats"  # server -> site: send feature statistics (bool); site -> server: {label: {n, mean, cov}}

PHASES = ("main", "extra")
