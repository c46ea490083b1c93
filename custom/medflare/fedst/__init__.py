"""FedST (Ma et al., AAAI 2024): federated style transfer with a label-conditioned diffusion generator; FedST-separate
(per-site generators in a shared style store) and FedST-join (one federated generator with a domain vector), both
training the segmentation model by FedAvg on real and cross-domain synthetic images (Eq. 3).

Functional core (no FLARE): :mod:`.conditioning` (label map and domain vector), :mod:`.diffusion` (MONAI
DiffusionModelUNet / schedulers / DiffusionInferer, L_simple of Eq. 2, training and sampling), :mod:`.losses`
(Eq. 3), :mod:`.comm` (communication cost, Eq. 4), :mod:`.cache` (a site's own folder). FLARE shell: :mod:`.protocol`,
:mod:`.executor` (generator training, sampling, segmentation), :mod:`.controller` (``FedSTSeparateController``,
``FedSTJoinController``), :mod:`.persistor` (the only writer of the saved files), :mod:`.results` (their kinds and
layout), :mod:`.recipe`.
"""
