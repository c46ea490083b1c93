"""CPU time of one FedST-join local generator step: L_simple and the other-domain term from one forward pass over
both halves stacked into a batch of 2B (what ``medflare.fedst.diffusion.train_generator`` does), against the two
passes that define them (``simple_loss`` + ``other_domain_term``), and a plain step without the term (FedST-separate).

    python benchmarks/fedst_join_step.py [--preset fedst_tiny] [--steps 30] [--threads 1] [--repeats 2]

Each step: forward, backward and Adam's update of the preset's generator (two domains) on random [-1, 1] images and
label maps of the preset's size and batch. Prints the mean process CPU seconds per step of each variant, measured
``--repeats`` times in turn after 3 warm-up steps (results in benchmarks/RESULTS_speed.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from medflare.fedst import diffusion as D
from medflare.fedst.conditioning import domain_vectors, encode_labels
from medflare.fedst.config import DiffusionConfig
from medflare.presets import get_preset


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="fedst_tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    preset = get_preset(args.preset)
    cfg = DiffusionConfig.from_preset(preset)
    size, classes, batch = int(preset["data"]["image_size"]), int(preset["data"]["num_classes"]), cfg.batch_size
    generator = D.build_style_generator(D.generator_args(cfg, 1, classes, 2))
    reference, scheduler = D.frozen_copy(generator), D.training_scheduler(cfg)
    optimizer = D.generator_optimizer(generator, cfg)
    images = torch.rand(batch, 1, size, size) * 2 - 1
    cond = encode_labels(torch.randint(0, classes, (batch, 1, size, size)), classes)
    own, other = domain_vectors(0, 2, batch), domain_vectors(1, 2, batch)

    def step(variant: str) -> None:
        noise, t = torch.randn_like(images), D.draw_timesteps(scheduler, batch)
        optimizer.zero_grad(set_to_none=True)
        if variant == "one pass":
            value, kept = D.simple_and_other_domain_losses(generator, reference, scheduler, images, cond, noise, t, own, other)
            total = value + cfg.keep_other_domains * kept
        elif variant == "two passes":
            total = (D.simple_loss(generator, scheduler, images, cond, noise, t, own)
                     + cfg.keep_other_domains * D.other_domain_term(generator, reference, scheduler, images, cond, noise, t, other))
        else:
            total = D.simple_loss(generator, scheduler, images, cond, noise, t, own)
        total.backward()
        optimizer.step()

    print(f"{args.preset}: {size}x{size}, batch {batch}, {args.threads} thread(s), {args.steps} steps per measurement")
    for repeat in range(args.repeats):
        for variant in ("no other-domain term", "two passes", "one pass"):
            for _ in range(3):
                step(variant)
            tic = time.process_time()
            for _ in range(args.steps):
                step(variant)
            print(f"  [{repeat + 1}] {variant:22s} {(time.process_time() - tic) / args.steps:.3f} CPU s per step")


if __name__ == "__main__":
    main()
