"""What the FedST server and sites exchange besides the weights: task names, payload prefixes and task-meta keys.

Weights travel in the DXO data, where FLARE's filters and the sites' privacy scopes see them:

- server -> site: FULL weights (a WEIGHTS DXO) with prefixes ``seg.`` (the global segmentation model),
  ``gen.`` (FedST-join's global generator, or only its domain modulation ``gen.modulation.*`` in the exchanges
  ``diffusion.sync_layers`` "domain" makes partial) or ``gen_<i>.`` (the style-store generator of site i of ``SITES``);
- site -> server (:func:`manifest`): ``train``: WEIGHT_DIFF of the segmentation model (``seg.``, part ``update``) and
  the received model's validation scores (a METRICS part); ``train_generator``: the site's generator as WEIGHTS
  (FedST-separate, ``gen.``) or its WEIGHT_DIFF (FedST-join, ``gen.``: the whole generator's, or the domain
  modulation's when the task meta's :data:`UPLOAD` says "domain"), part ``generator``, and a STATISTICS part
  :data:`SUMMARY` (its label classes, image size, generator losses); ``sample`` and ``validate``: METRICS only.
  The cross-domain images a site draws stay at the site.

Task meta (server -> site) carries small facts about the job (site names, the classes of each site's generator,
round numbers, step counts); a site's reply carries data only in parts its privacy scope sees.
"""

from nvflare.apis.dxo import MetaKey

from medflare.common.egress import RESULT, Send, declare

TRAIN_GENERATOR = "train_generator"  # train the style generator (separate: own; join: the global one), send it
SAMPLE = "sample"  # draw cross-domain images from the site's own label maps (kept at the site)
TRAIN = "train"  # segmentation round: Eq. 3 on real + cached synthetic images, send the weight diff

PART_UPDATE = "update"  # the segmentation model's weight diff in a ``train`` reply
PART_GENERATOR = "generator"  # the generator (or its diff) in a ``train_generator`` reply

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
UPLOAD = "fedst_generator_upload"  # FedST-join: the generator part to send back, "all" or "domain" (diffusion.sync_layers)
REFRESH = "fedst_refresh"  # bool: regenerate the cached synthetic images from the current generator(s)
VERSIONS = "fedst_versions"  # {site: round its generator in the store was uploaded}
CLASSES = "fedst_classes"  # server -> site: {site: classes its generator was trained on}
CDS_LAMBDA = "fedst_cds_lambda"  # lambda of Eq. 3
#: site -> server, a STATISTICS part of the generator reply (lifted into the result's meta on the server): "classes"
#: (the site's label classes), "image_size" ([H, W] of its images), "loss_first" / "loss_last" / "loss_mean" (L_simple)
SUMMARY = "fedst_generator_summary"

VARIANTS = ("separate", "join")


def manifest(join: bool) -> dict:
    """What a FedST site sends per task; ``join``:
    FedST-join (generator diffs every round) or -separate (the generator once). The generator's size depends on the
    number of sites (FedST-join's domain vectors), so no byte bound is computed for it here."""
    generator = (Send(PART_GENERATOR, "WEIGHT_DIFF", "the change of the joint generator (with its domain vector), or of its domain "
                      "modulation alone (diffusion.sync_layers 'domain')")
                 if join else Send(PART_GENERATOR, "WEIGHTS", "the site's own style generator", cadence="once"))
    return declare({
        TRAIN_GENERATOR: [generator, Send(SUMMARY, "STATISTICS", "the site's label classes, image size and generator losses",
                                          cadence=generator.cadence)],
        SAMPLE: [Send(RESULT, "METRICS", "counts of the cross-domain images drawn (the images stay at the site)")],
        TRAIN: [Send(PART_UPDATE, "WEIGHT_DIFF", "the segmentation model's change in this round", models=1),
                Send(MetaKey.INITIAL_METRICS, "METRICS", "validation scores of the received segmentation model")],
        "validate": [Send(RESULT, "METRICS", "the final segmentation model's validation and test scores", cadence="last round")],
    })
