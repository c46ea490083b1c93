"""Model builders: MONAI networks first, plus the small classifiers the papers' references use.

``build_from_spec({"name", "args"})`` (a preset's or a saved result's ``model`` entry) and
``build_model(name, **args)`` are the one entry point; the classes are
exported for code that needs ``.features()`` / ``.classifier`` (FedVCK, FedIOD).
"""

from medflare.nets.convnet import ConvNet
from medflare.nets.factory import MODEL_NAMES, build_from_spec, build_model, build_unet, count_parameters
from medflare.nets.resnet import BasicBlock, ResNet8, ResNet18

__all__ = [
    "MODEL_NAMES",
    "BasicBlock",
    "ConvNet",
    "ResNet8",
    "ResNet18",
    "build_from_spec",
    "build_model",
    "build_unet",
    "count_parameters",
]
