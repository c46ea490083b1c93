"""FedIOD (Gong et al., AAAI 2024): data-free federated learning by input/output collaborative distillation.

Functional core (no FLARE): :mod:`.losses` (Eq. 1-10), :mod:`.networks` (generators and critics from MONAI's GAN
parts), :mod:`.privacy` (per-input clipping, Gaussian noise, opacus RDP accounting), :mod:`.teacher` (stage 1),
:mod:`.site` and :mod:`.server` (stage 2 at a site and at the server; the gradient split between them),
:mod:`.config` (the preset's ``fediod`` section), :mod:`.build` (the same parts for server, sites, tests and
benchmarks), :mod:`.samples`. FLARE shell: :mod:`.controller` (``FedIODController``), :mod:`.executor`
(``FedIODExecutor``), :mod:`.persistor` (``FedIODPersistor``), :mod:`.protocol` (task names and DXO kinds),
:mod:`.results` (the ``fediod_student`` result kind), :mod:`.recipe` (jobs/fediod, jobs/fediod_seg).
"""
