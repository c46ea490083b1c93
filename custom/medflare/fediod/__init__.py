"""FedIOD (Gong et al., AAAI 2024): data-free federated learning by input/output collaborative distillation.

Functional core (no FLARE): :mod:`.losses` (Eq. 1-10), :mod:`.networks` (the generator, discriminator and student
specs and networks from a preset; the GAN parts themselves are :mod:`medflare.nets.gan`), :mod:`.privacy`
(per-input clipping, Gaussian noise, opacus RDP accounting), :mod:`.teacher` (stage 1), :mod:`.site_distill` and
:mod:`.distill` (stage 2 at a site and at the server; the gradient split between them), :mod:`.replay`,
:mod:`.calibration` (the segmentation student's decision offset), :mod:`.samples`, :mod:`.config` (the preset's ``fediod`` section). FLARE shell: :mod:`.controller`
(``FedIODController``), :mod:`.executor` (``FedIODExecutor``), :mod:`.persistor` (``FedIODPersistor``, the only
writer of the student file), :mod:`.protocol` (task names and DXO kinds), :mod:`.results` (the ``fediod_student``
result kind), :mod:`.recipe` (jobs/fediod, jobs/fediod_seg).
"""
