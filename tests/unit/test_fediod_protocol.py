"""The federated split of FedIOD's generator gradient (medflare.fediod.distill docstring): the server's own term plus
each site's vector-Jacobian product equals, with noise off, the gradient of the single-process loss on the same
networks and batches; a site's NaN is dropped and named; class-count mismatches and budgets are handled."""

import copy

import pytest
import torch

from medflare import PayloadError
from medflare.fediod import losses as L
from medflare.fediod.config import FedIODConfig
from medflare.nets.gan import LabelGenerator, LatentGenerator, PatchCritic, one_hot
from medflare.fediod.privacy import PrivacySettings
from medflare.fediod.distill import Distiller, LocalFederation, SiteInfo
from medflare.fediod.site_distill import SiteDistiller
from medflare.nets import ConvNet, ResNet8, build_unet
from medflare.nets.batchnorm import forward_with_bn_prior

C, B, S = 4, 6, 16


def _real(seed, task):
    g = torch.Generator().manual_seed(seed)
    while True:
        label = torch.randint(0, C, (B, 1, S, S), generator=g) if task == "segmentation" else torch.randint(0, C, (B,), generator=g)
        yield {"image": torch.rand(B, 1, S, S, generator=g), "label": label}


def _setup(task, ensemble="eq8", lam=None, privacy=None):
    torch.manual_seed(0)
    lam = dict(lam or {})
    styles = lam.pop("styles", 0)
    cfg = FedIODConfig(batch_size=B, steps_per_window=1, cosine=False, ensemble=ensemble, **lam)
    if task == "segmentation":  # two architectures: UNets of different depth
        teachers = [build_unet(1, C, [4, 8], [2]).eval(), build_unet(1, C, [4, 8, 8], [2, 2]).eval()]
        G, student = LabelGenerator(C, 1, width=4, blocks=1, styles=styles), build_unet(1, C, [4, 8], [2])
        critic_in = 1 + C if cfg.conditional_critic else 1
    else:  # two architectures: ResNet-8 and ConvNet
        teachers = [ResNet8(1, C, (4, 8, 8)).eval(), ConvNet(1, C, S, width=8).eval()]
        G, student = LatentGenerator(latent_dim=8, image_size=S, width=8), ResNet8(1, C, (4, 8, 8))
        critic_in = 1
    discs = [PatchCritic(critic_in, 8, 2), PatchCritic(critic_in, 8, 2)]
    counts = [torch.tensor([10.0, 0, 5, 1]), torch.tensor([1.0, 7, 0, 3])]
    sizes = [16, 11]
    ref = {"G": copy.deepcopy(G), "S": copy.deepcopy(student), "D": [copy.deepcopy(d) for d in discs], "T": teachers,
           "counts": counts, "sizes": sizes}
    sites = {f"site-{k}": SiteDistiller(teachers[k], discs[k], _real(k, task), cfg, task, C, privacy=privacy, seed=k) for k in range(2)}
    labels = torch.randint(0, C, (20, 1, S, S), generator=torch.Generator().manual_seed(5)) if task == "segmentation" else None
    dist = Distiller(G, student, cfg, task, C, label_maps=labels, seed=3)
    dist.set_sites({f"site-{k}": SiteInfo(counts[k], sizes[k]) for k in range(2)})
    return dist, LocalFederation(sites), ref, cfg


def _single_process_grad(window, ref, cfg, task, drop=()):
    """The generator loss of Algorithm 1 written as one graph, differentiated by autograd."""
    G, Snet = ref["G"], ref["S"]
    x = G(window.w[0])
    y = window.y[0] if window.y is not None else None
    keep = [k for k in range(2) if f"site-{k}" not in drop]
    z, prior = zip(*[forward_with_bn_prior(ref["T"][k], x) for k in keep])
    conditional = task == "segmentation" and cfg.conditional_critic
    crit = lambda k, img, lab: ref["D"][k](torch.cat([one_hot(lab, C), img], 1) if conditional else img)  # noqa: E731
    means, logits = [], []
    for k in keep:
        real = next(_real(k, task))
        means.append(L.discriminator_score(crit(k, real["image"], real["label"])).mean().clamp_min(1e-6))
        logits.append(crit(k, x, y))
    r = torch.stack([L.discriminator_score(lg) / m for lg, m in zip(logits, means)])
    pi = L.site_weights([ref["sizes"][k] for k in keep]).float()
    ratio = L.label_ratio(torch.stack([ref["counts"][k] for k in keep]))
    if cfg.ensemble == "mean":
        w = torch.full((len(keep), x.shape[0], C), 1.0 / len(keep))
    else:
        factor = r if cfg.ensemble == "eq8" else None
        if cfg.ensemble_confidence:  # a routing: no gradient through the teachers' confidence
            sure = torch.stack([L.confidence(zk.detach()) for zk in z]) ** cfg.ensemble_confidence
            factor = sure if factor is None else factor * sure
        w = L.ensemble_weights(ratio, factor).expand(len(keep), x.shape[0], C)
    A = L.aggregate(z, w, cfg.ensemble_tau)
    if window.site is not None:  # styled G: input i is judged by the critic of the site it was drawn for, alone
        gan = sum((window.site[0] == k).float() * L.generator_adv_loss(logits[i]) for i, k in enumerate(keep))
    else:
        gan = sum(pi[i] * L.generator_adv_loss(logits[i]) for i in range(len(keep)))
    if y is not None and window.site is not None:  # styled G: each input's label term through its own site's teacher
        own = torch.stack(z)[window.site[0], torch.arange(x.shape[0])] if len(keep) == 2 else None
        label = L.label_loss(own, y)
    else:
        label = L.label_loss(A, y) if y is not None else 0.0
    loss = (cfg.lambda_conf * L.conf_loss(z, pi) + cfg.lambda_unique * L.unique_loss(z, pi)
            - cfg.lambda_mimic * L.mimic_loss(Snet(x), A, cfg.mimic_tau) + cfg.lambda_gan * gan + cfg.lambda_label * label).mean()
    loss = loss + cfg.lambda_balance * L.balance_loss(A, cfg.tau) + cfg.lambda_bn * sum(pi[i] * prior[i] for i in range(len(keep)))
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(G.parameters()))])


def _federated_grad(dist, fed):
    window = dist.sample()
    outputs, _ = fed.outputs(window.inputs(), window.labels())
    req = dist.combine(window, outputs)
    vjps = fed.input_gradients(req.grads)
    grads = dist.generator_gradients(window, req, vjps)
    return window, req, torch.cat([g.reshape(-1) for g in grads[0]])


@pytest.mark.parametrize("task, ensemble, lam", [
    ("classification", "eq8", None),
    ("classification", "labels", {"mimic_tau": 1.0, "lambda_gan": 0.5}),
    ("classification", "mean", {"lambda_balance": 2.0, "lambda_unique": 0.0}),
    ("classification", "eq8", {"ensemble_tau": 2.0, "mimic_tau": 1.0, "lambda_balance": 1.0}),
    ("segmentation", "labels", {"ensemble_tau": 1.0, "lambda_label": 1.0}),
    ("classification", "eq8", {"ensemble_tau": 1.0, "ensemble_confidence": 4.0, "mimic_tau": 1.0}),
    ("segmentation", "labels", {"ensemble_confidence": 2.0, "lambda_label": 1.0}),
    ("classification", "eq8", {"lambda_bn": 0.7, "mimic_tau": 1.0}),
    ("segmentation", "eq8", {"lambda_conf": 0.3}),
    ("segmentation", "eq8", {"styles": 3, "lambda_label": 0.8, "student_label": 1.0, "lambda_gan": 2.0}),
    ("segmentation", "labels", {"styles": 2, "lambda_label": 1.0}),
    ("segmentation", "eq8", {"styles": 3, "lambda_label": 0.8, "lambda_gan": 2.0, "conditional_critic": False}),
])
def test_federated_generator_gradient_equals_single_process(task, ensemble, lam):
    dist, fed, ref, cfg = _setup(task, ensemble, lam)
    window, _, fed_grad = _federated_grad(dist, fed)
    ref_grad = _single_process_grad(window, ref, cfg, task)
    assert ref_grad.norm() > 0
    assert torch.allclose(fed_grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item()), (fed_grad - ref_grad).abs().max()


def _one_window(lam):
    """One window of a classification run with ``lam``: (the distiller, the first step's teacher logits, their
    discriminator factors, Eq. 8's label factor)."""
    dist, fed, _, _ = _setup("classification", lam={**lam, "replay_size": 64})
    window = dist.sample()
    outputs, _ = fed.outputs(window.inputs(), window.labels())
    dist.combine(window, outputs)
    z = [outputs[s][0][0].float() for s in sorted(outputs)]
    r = torch.stack([outputs[s][1][0].float().clamp_min(0) for s in sorted(outputs)])
    return dist, z, r, L.label_ratio(torch.stack([dist.sites[s].counts for s in sorted(outputs)]))


def test_the_students_target_is_the_mixture_of_the_teachers_probabilities_with_ensemble_tau():
    dist, z, r, ratio = _one_window({"ensemble_tau": 2.0, "mimic_tau": 1.0})
    w = L.ensemble_weights(ratio, r).expand(2, B, C)
    assert torch.allclose(dist.bank.target, L.aggregate(z, w, tau=2.0), atol=1e-5)  # the replay bank keeps the target
    assert not torch.allclose(dist.bank.target, L.aggregate(z, w), atol=1e-3)


def test_ensemble_confidence_reweighs_the_students_target_by_each_teachers_top_probability():
    dist, z, r, ratio = _one_window({"ensemble_tau": 1.0, "ensemble_confidence": 4.0})
    sure = torch.stack([L.confidence(zk) for zk in z]) ** 4
    with_factor = L.aggregate(z, L.ensemble_weights(ratio, r * sure).expand(2, B, C), tau=1.0)
    assert torch.allclose(dist.bank.target, with_factor, atol=1e-5)
    assert not torch.allclose(dist.bank.target, L.aggregate(z, L.ensemble_weights(ratio, r).expand(2, B, C), tau=1.0), atol=1e-3)


def test_each_term_reaches_the_generator():
    """The test above would pass if a coupled term were dropped on both sides: check the sites' terms matter."""
    dist, fed, ref, cfg = _setup("classification")
    window, req, full = _federated_grad(dist, fed)
    assert all(g_r.abs().sum() > 0 for _, g_r, *_ in req.grads.values())  # Eq. 8's D factor gets a gradient
    own_only = dist.generator_gradients(window, req, {})  # the server's term alone
    assert not torch.allclose(full, torch.cat([g.reshape(-1) for g in own_only[0]]))
    dist, fed, _, _ = _setup("classification", lam={"lambda_bn": 0.7})  # same seeds, the teachers' BN prior on
    window, req, with_prior = _federated_grad(dist, fed)
    assert all(b > 0 for *_, b in req.grads.values())
    assert not torch.allclose(full, with_prior, rtol=1e-3)


def test_nan_site_is_dropped_named_and_the_rest_is_exact():
    dist, fed, ref, cfg = _setup("classification")
    bad = fed.sites["site-1"]
    bad.teacher.classifier.bias.data[:] = float("nan")
    logs = []
    dist.log = logs.append
    window, req, fed_grad = _federated_grad(dist, fed)
    assert "site-1" in req.dropped and "NaN" in req.dropped["site-1"]
    assert set(req.grads) == {"site-0"}
    ref_grad = _single_process_grad(window, ref, cfg, "classification", drop=("site-1",))
    assert torch.allclose(fed_grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item())
    dist.run_window(fed)  # a whole window with the NaN site: G and S stay finite, the log names the site
    assert all(torch.isfinite(p).all() for p in [*dist.G.parameters(), *dist.S.parameters()])
    assert any("site-1" in m and "NaN" in m for m in logs)


def test_nan_input_gradients_are_dropped():
    dist, fed, _, _ = _setup("classification")
    window = dist.sample()
    req = dist.combine(window, fed.outputs(window.inputs(), None)[0])
    vjps = fed.input_gradients(req.grads)
    vjps["site-0"][0, 0, 0, 0, 0] = float("inf")
    grads = dist.generator_gradients(window, req, vjps)
    assert "site-0" in req.dropped and all(torch.isfinite(g).all() for g in grads[0])


def test_mismatched_class_counts_are_refused():
    dist, _, _, _ = _setup("classification")
    with pytest.raises(PayloadError, match=r"site-9.*classes"):
        dist.set_sites({"site-0": SiteInfo(torch.ones(C), 5), "site-9": SiteInfo(torch.ones(C + 1), 5)})


def test_clipping_bounds_what_the_site_returns_and_noise_is_accounted():
    dist, fed, _, _ = _setup("classification", privacy=PrivacySettings(clip_norm=1e-4))
    window = dist.sample()
    req = dist.combine(window, fed.outputs(window.inputs(), None)[0])
    v = fed.input_gradients(req.grads)
    assert all(t.reshape(B, -1).norm(dim=1).max() <= 1e-4 * (1 + 1e-5) for t in v.values())
    assert fed.sites["site-0"].epsilon() == 0.0  # clipping alone is not DP: nothing accounted
    dp = PrivacySettings(noise_multiplier=4.0, clip_norm=1.0, epsilon_budget=1000.0)
    dist, fed, _, _ = _setup("classification", privacy=dp)
    dist.run_window(fed)
    assert 0 < fed.sites["site-0"].epsilon() < 1000.0


def test_a_site_out_of_budget_stops_and_says_why():
    dp = PrivacySettings(noise_multiplier=2.0, clip_norm=1.0, epsilon_budget=60.0)
    dist, fed, _, _ = _setup("classification", privacy=dp)
    for _ in range(30):
        req = dist.run_window(fed)
        if fed.stopped:
            break
    assert set(fed.stopped) == {"site-0", "site-1"} and "epsilon budget 60.0" in fed.stopped["site-0"]
    assert all(s.epsilon() <= 60.0 for s in fed.sites.values())
    assert req.grads == {}  # nobody answered: no step taken on stale or missing outputs


class _CountingFederation:
    """Counts the sites' two calls per window (the extra student steps must not add any)."""

    def __init__(self, fed):
        self.fed, self.calls = fed, 0

    def outputs(self, x, y):
        self.calls += 1
        return self.fed.outputs(x, y)

    def input_gradients(self, requests):
        self.calls += 1
        return self.fed.input_gradients(requests)


def _bank_fit(dist):
    """The student's mean L_mimic over everything the bank holds."""
    with torch.no_grad():
        return float(L.mimic_loss(dist.S(dist.bank.x), dist.bank.target, dist.cfg.mimic_tau).mean())


def test_extra_student_steps_fit_the_ensemble_better_without_extra_messages():
    """fediod.student_steps > 1 replays the server's bank (not in the paper): same two exchanges per window, same
    generated inputs, and a student that fits the ensemble's logits on them clearly better than Algorithm 1's."""
    windows = 6
    runs = {}
    for steps in (1, 4):
        dist, fed, _, _ = _setup("classification", lam={"student_steps": steps, "replay_size": 64, "lr_student": 3e-3})
        counting = _CountingFederation(fed)
        for _ in range(windows):
            dist.run_window(counting)
        assert counting.calls == 2 * windows  # two exchanges per window whatever student_steps is
        assert len(dist.bank) == min(64, windows * dist.cfg.batch_size) and dist.steps == windows
        runs[steps] = dist
    one, four = runs[1], runs[4]
    # both banks start with the same first generated batch (same seeds; G and S differ after it) ...
    assert torch.equal(one.bank.x[: one.cfg.batch_size], four.bank.x[: four.cfg.batch_size])
    # ... and the student that replayed it fits the ensemble's logits there clearly better
    fit_one, fit_four = _bank_fit(one), _bank_fit(four)
    assert fit_four < 0.8 * fit_one, (fit_one, fit_four)


@pytest.mark.parametrize("prob", [0.0, 1.0])
def test_only_the_students_replay_steps_see_perturbed_images(prob):
    """Algorithm 1's step (whose output enters G's loss) takes G's image as drawn, the bank keeps it as drawn, and the
    replay steps take a perturbed copy (with student_augment 0: the bank's entries themselves)."""
    dist, fed, _, _ = _setup("segmentation", lam={"student_steps": 3, "replay_size": 64, "student_augment": prob})
    seen = []
    hook = dist.S.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    window = dist.sample(steps=1)
    dist.combine(window, fed.outputs(window.inputs(), window.labels())[0])
    hook.remove()
    x = window.inputs()[0]
    assert len(seen) == 3 and torch.equal(seen[0], x) and torch.equal(dist.bank.x, x)
    # the bank holds only this batch, so a replay step's batch is made of its images, perturbed or not
    for batch in seen[1:]:
        as_drawn = all(any(torch.equal(img, ref) for ref in x) for img in batch)
        assert as_drawn == (prob == 0.0)


def test_algorithm_1_keeps_no_bank():
    dist, fed, _, _ = _setup("classification")
    dist.run_window(fed)
    assert dist.bank is None and dist.cfg.student_steps == 1


def test_styled_generator_gives_each_input_one_sites_critic():
    """With style codes every input is drawn for one site, uniformly over the sites, and only that site's critic is
    asked for its GAN term: per-input weights lambda_gan on its own inputs, 0 elsewhere; a site checks their shape."""
    dist, fed, _, cfg = _setup("segmentation", lam={"styles": 3, "lambda_gan": 2.0})
    window = dist.sample(steps=4, batch=50)
    drawn = torch.cat(window.site)
    assert set(drawn.tolist()) == {0, 1}  # two registered sites; code = site index mod styles
    assert abs(float((drawn == 0).float().mean()) - 0.5) < 0.15
    outputs, _ = fed.outputs(window.inputs(), window.labels())
    req = dist.combine(window, outputs)
    adv = {s: g[2] for s, g in req.grads.items()}
    assert all(a.shape == (4, 50) for a in adv.values())
    assert torch.equal(adv["site-0"] + adv["site-1"], torch.full((4, 50), 2.0))
    assert torch.equal(adv["site-1"] > 0, torch.stack(window.site) == 1)
    g_z, g_r, _, b = req.grads["site-0"]
    with pytest.raises(PayloadError, match="GAN weight"):
        fed.sites["site-0"].input_gradients(g_z, g_r, torch.ones(3, 50), b)


def test_student_label_term_moves_the_student_towards_the_label_maps():
    """student_label adds the cross-entropy to the conditioning label maps to the student's loss (and the replay bank
    then keeps the label maps with their inputs)."""
    losses = {}
    for weight in (0.0, 5.0):
        dist, fed, _, _ = _setup("segmentation", lam={"student_label": weight, "student_steps": 3, "replay_size": 64})
        window = dist.sample(steps=1)
        for _ in range(6):
            dist.combine(window, fed.outputs(window.inputs(), window.labels())[0])
        assert (dist.bank._label is not None) == (weight > 0)
        with torch.no_grad():
            losses[weight] = float(L.label_loss(dist.S(window.inputs()[0]), window.labels()[0]).mean())
    assert losses[5.0] < losses[0.0] - 0.05, losses


@pytest.mark.parametrize("conditional", [True, False])
def test_a_sites_critic_takes_the_label_map_only_when_conditional(conditional):
    """The job's own path (``site_distiller`` -> ``site_discriminator``) builds D_k for the input the site gives it: the
    one-hot label map and the image, or with ``conditional_critic`` false the image alone; a window passes through."""
    from medflare.fediod.site_distill import site_distiller
    from medflare.presets import get_preset

    cfg = get_preset("fediod_seg_tiny", {"fediod": {"conditional_critic": conditional}})
    fcfg = FedIODConfig.from_preset(cfg)
    teacher = build_unet(1, 3, [4, 8], [2]).eval()
    train = [{"image": torch.rand(1, 32, 32), "label": torch.randint(0, 3, (1, 32, 32))} for _ in range(8)]
    site = site_distiller(cfg, fcfg, "site-1", teacher, train, None, seed=0)
    first = next(m for m in site.disc.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == (1 + 3 if conditional else 1)
    x, y = torch.rand(1, 2, 1, 32, 32), torch.randint(0, 3, (1, 2, 1, 32, 32))
    z, r = site.outputs(x, y)
    assert z.shape == (1, 2, 3, 32, 32) and r.shape == (1, 2) and torch.isfinite(r).all()
