"""FedVCK (Yan et al., AAAI 2025): sites condense their data into small synthetic image sets, the server trains on them.

Functional core (plain torch, no FLARE): :mod:`.mmd` (Eq. 2-3, 9), :mod:`.latent` (Eq. 4), :mod:`.importance`
(Eq. 5-8), :mod:`.augment` (differentiable Siamese augmentation), :mod:`.condense` (the site's condensation
loop), :mod:`.prototypes` (Eq. 11-14), :mod:`.contrastive` (Eq. 15-16), :mod:`.update` (the server's round),
:mod:`.audit`, :mod:`.config` (the preset's ``fedvck`` section). FLARE shell: :mod:`.protocol` (with the reply's
packing and checked reading), :mod:`.filters`, :mod:`.executor`, :mod:`.controller`, :mod:`.persistor` (the only
writer of ``FedVCK_result.pt``), :mod:`.results` (its kind, layout and loader), :mod:`.recipe`.
"""
