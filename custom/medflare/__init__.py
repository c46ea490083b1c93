"""medflare: federated medical imaging on non-IID hospitals, as NVIDIA FLARE jobs.

The package holds the data, model and metric layer shared by every job, and one sub-package per
algorithm (baselines, fedsm, ...). FLARE components are referenced from job configs by full class
path (``medflare.baselines.executor.SupervisedExecutor``) so the same code serves simulator, POC
and production.
"""

__version__ = "0.1.0"


class MedflareError(Exception):
    """An error a user can cause (bad file, wrong shape, empty site, unknown key).

    The message always names the file, site or config key at fault, so that a hospital operator can
    fix the input without reading a traceback from deep inside a library.
    """


__all__ = ["MedflareError", "__version__"]
