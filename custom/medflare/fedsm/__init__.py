"""FedSM (Xu et al., CVPR 2022): federated super model = FedAvg global model + SoftPull personalised models
+ model selector, inference by selector confidence (Algorithm 2), FedSM-extra as an option.

Functional core (no FLARE): :mod:`.softpull` (Eq. 11, weighted averaging), :mod:`.routing` (Algorithm 2),
:mod:`.extra` (Eq. 1 labels), :mod:`.calibrate` (selector head from feature statistics,
CCVR-style), :mod:`.supermodel` (the saved file). FLARE shell: :mod:`.controller`
(``FedSMController``), :mod:`.executor` (``FedSMExecutor``); job configs name them by full path.
"""
