"""medflare: federated medical imaging on non-IID hospitals, as NVIDIA FLARE jobs.

The package holds the data, model and metric layer shared by every job, and one sub-package per
algorithm (baselines, fedsm, ...). FLARE components are referenced from job configs by full class
path (``medflare.baselines.executor.SupervisedExecutor``) so the same code serves simulator, POC
and production.
"""

__version__ = "0.2.0"


class MedflareError(Exception):
    """An error a user can cause (bad file, wrong shape, empty site, unknown key).

    The message always names the file, site or config key at fault, so that a hospital operator can
    fix the input without reading a traceback from deep inside a library. Callers that must tell cases
    apart catch a subclass (never inspect the message text); ``site`` is set once a message names the
    site, so wrappers do not name it twice.
    """

    site: str | None = None

    def for_site(self, site: str) -> "MedflareError":
        """This error with the site named in front, once: ``site 'S': <message>`` (same class)."""
        if self.site is not None:
            return self
        err = type(self)(f"site '{site}': {self}")
        err.site = site
        return err


class DataError(MedflareError):
    """A site's data is missing, unreadable or inconsistent (datalist, image, label, .npz)."""


class ConfigError(MedflareError):
    """A job, preset, recipe or site configuration is wrong (unknown key or name, value out of range)."""


class PayloadError(MedflareError):
    """What arrived over the wire cannot be used: wrong keys or shapes, NaN/Inf, a kind the receiver does not take."""


class PrivacyError(PayloadError):
    """A site's privacy scope removed or blocked what the algorithm needs (say which scope and which payload)."""


class ResultFileError(MedflareError):
    """A saved result (checkpoint, super model, generator) cannot be read: missing, corrupt, unsafe, unknown kind."""


__all__ = [
    "ConfigError",
    "DataError",
    "MedflareError",
    "PayloadError",
    "PrivacyError",
    "ResultFileError",
    "__version__",
]
