"""Model builders: MONAI networks first, plus the small classifiers the papers' references use.

``build_from_spec({"name", "args"}, role="model")`` (a preset's or a saved result's ``model`` entry; role "generator"
or "discriminator" for the GAN parts of :mod:`.gan`, or a role an algorithm added with ``register``) and
``build_model(name, **args)`` are the one entry point; the classes are
exported for code that needs ``.features()`` / ``.classifier`` (FedVCK, FedIOD).
"""

from medflare.nets.convnet import ConvNet
from medflare.nets.factory import MODEL_NAMES, build_from_spec, build_model, build_unet, count_parameters, register
from medflare.nets.gan import LabelGenerator, LatentGenerator, PatchCritic
from medflare.nets.resnet import BasicBlock, ResNet8, ResNet18

__all__ = [
    "MODEL_NAMES",
    "BasicBlock",
    "ConvNet",
    "LabelGenerator",
    "LatentGenerator",
    "PatchCritic",
    "ResNet8",
    "ResNet18",
    "build_from_spec",
    "build_model",
    "build_unet",
    "count_parameters",
    "register",
]
