"""FedSM (Xu et al., CVPR 2022): federated super model = FedAvg global model + SoftPull personalised models
+ model selector, inference by selector confidence (Algorithm 2), FedSM-extra as an option.

Functional core (no FLARE): :mod:`.softpull` (Eq. 11), :mod:`.density` (per-site feature Gaussians and
their calibration), :mod:`.selector` (the global encoder's features + the Gaussians), :mod:`.routing`
(Algorithm 2), :mod:`.extra` (Eq. 1 labels, the FedSM-extra head), :mod:`.aggregate` (one server round),
:mod:`.scoring` (a site's per-round scores in one pass), :mod:`.supermodel` (the container network). FLARE
shell: :mod:`.protocol` (names both sides use), :mod:`.controller` (``FedSMController``), :mod:`.executor`
(``FedSMExecutor``), :mod:`.persistor` (``SuperModelPersistor``, the only writer of the super-model file),
:mod:`.results` (its kind, layout and loader), :mod:`.recipe`; job configs name them by full path.
"""
