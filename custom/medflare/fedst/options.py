"""The command-line options of FedST's result kinds (torch-free: ``medflare sample --help`` imports only this)."""

from medflare.common.options import KindOptions, Option

DOMAIN = Option("domain", "the site whose style `sample` draws (one of the sites in the file; see `medflare show`)",
                parse=str, commands=("sample",))
FEDST_OPTIONS = KindOptions("FedST results", (DOMAIN,))
