"""What the FedST server and sites exchange besides the weights: task names, payload prefixes and task-meta keys.

Weights travel in the DXO data, where FLARE's filters and the sites' privacy scopes see them:

- server -> site: FULL weights (a WEIGHTS DXO) with prefixes ``seg.`` (the global segmentation model),
  ``gen.`` (FedST-join's global generator) or ``gen_<i>.`` (the style-store generator of site i of ``SITES``);
- site -> server: ``train``: WEIGHT_DIFF of the segmentation model (``seg.``); ``train_generator``: the site's
  generator as WEIGHTS (FedST-separate, ``gen.``) or its WEIGHT_DIFF (FedST-join, ``gen.``).

The meta carries only small facts about the job (site names, which classes a site's labels hold, its image
size, round numbers, step counts), never weights or images.
"""

TRAIN_GENERATOR = "train_generator"  # train the style generator (separate: own; join: the global one), send it
SAMPLE = "sample"  # draw cross-domain images from the site's own label maps (kept at the site)
TRAIN = "train"  # segmentation round: Eq. 3 on real + cached synthetic images, send the weight diff

SEG = "seg"  # payload prefix of the segmentation model
GEN = "gen"  # payload prefix of a site's own / the join generator


def store_prefix(index: int) -> str:
    """Payload prefix of the style-store generator of the site at ``index`` in ``SITES``."""
    return f"gen_{index}"


# ---- task meta (server -> site) ----
VARIANT = "fedst_variant"  # "separate" | "join"
SITES = "fedst_sites"  # [site names]; a site's domain index is its position here
STEPS = "fedst_generator_steps"  # generator steps to train in this task
EXCHANGE = "fedst_generator_exchange"  # FedST-join: index of this generator exchange within the round (seeds batches)
EXCHANGES = "fedst_generator_exchanges"  # FedST-join: generator exchanges in the round (the last one is cached for sampling)
REFRESH = "fedst_refresh"  # bool: regenerate the cached synthetic images from the current generator(s)
VERSIONS = "fedst_versions"  # {site: round its generator in the store was uploaded}
CLASSES = "fedst_classes"  # server -> site: {site: classes its generator was trained on}; site -> server: own classes
CDS_LAMBDA = "fedst_cds_lambda"  # lambda of Eq. 3
IMAGE_SIZE = "fedst_image_size"  # site -> server: [H, W] of the site's images
LOSS = "fedst_generator_loss"  # site -> server: {"first", "last", "mean"} L_simple of this task

VARIANTS = ("separate", "join")
