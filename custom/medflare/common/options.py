"""The command-line options a result kind takes, declared without torch so that ``medflare <command> --help`` is fast.

Each algorithm declares its kinds' options in a torch-free module (``medflare/<algo>/options.py``) and registers
them as ``medflare.result_kind_options`` entry points (``<kind name> = "<module>:<KindOptions>"``); its
``results.py`` builds the kind (:class:`medflare.common.results.ResultKind`) from the same objects, so the help
the CLI shows and the options a loaded kind parses are one declaration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: the commands that take result-kind options
KIND_COMMANDS = ("evaluate", "predict", "sample")
#: the entry-point group of every kind's options (pyproject.toml)
OPTION_POINTS = "medflare.result_kind_options"


@dataclass(frozen=True)
class Option:
    """A setting a kind accepts from the CLI (``--<name> VALUE``, parsed by ``parse``) in ``commands``; a kind may take
    a list (FedSM's comma-separated gamma sweep) and return one predictor per value."""

    name: str
    help: str
    parse: Callable[[str], Any] = float
    commands: tuple[str, ...] = KIND_COMMANDS


@dataclass(frozen=True)
class KindOptions:
    """The options of one or more kinds, under the header ``title`` in a command's help (e.g. "FedSM results")."""

    title: str
    options: tuple[Option, ...]


def declared_options() -> dict[str, KindOptions]:
    """``{kind name: KindOptions}`` from the installed entry points (imports only the torch-free option modules)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.load() for ep in entry_points(group=OPTION_POINTS)}


def options_for(command: str) -> dict[str, tuple[list[str], tuple[Option, ...]]]:
    """``{title: ([kind names], options)}``: the kinds' options that ``command`` takes, one group per title."""
    groups: dict[str, tuple[list[str], tuple[Option, ...]]] = {}
    for name, declared in sorted(declared_options().items()):
        applying = tuple(o for o in declared.options if command in o.commands)
        if not applying:
            continue
        names, known = groups.setdefault(declared.title, ([], ()))
        names.append(name)
        groups[declared.title] = (names, known + tuple(o for o in applying if o.name not in {k.name for k in known}))
    return groups
