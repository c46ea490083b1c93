"""Why a site is missing from a round: the cause rides on the site's error reply, so the server can name it.

A site that cannot do its task (no training data, a config its checks refuse, a file gone bad) answers the task
with an error reply instead of stopping: FLARE's workflows that ignore result errors then count it as missing for
the round, and none waits forever for a site that will never answer (issue 28: FedAvg hung at "Aggregated 2/3").
The reply carries the cause as one line in the header :data:`CAUSE_HEADER` (the same line the site logs; it names
the site and the file or key at fault, never data), and the server's update guard puts its own reason there when it
refuses a result. The workflows collect the causes per round with :class:`MissingSites`, and when too few sites
answered they end the job with one line naming each missing site and its cause.
"""

from __future__ import annotations

from typing import Iterable

from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable, make_reply

#: Shareable header of an error reply: the one-line cause (site, file or key), at most :data:`MAX_CAUSE` characters
CAUSE_HEADER = "medflare_cause"
MAX_CAUSE = 500


def error_reply(rc: str, cause: str) -> Shareable:
    """An error reply with return code ``rc`` that carries ``cause`` (one line, truncated to :data:`MAX_CAUSE`)."""
    reply = make_reply(rc)
    reply.set_header(CAUSE_HEADER, one_line_cause(cause))
    return reply


def one_line_cause(cause: str) -> str:
    """``cause`` on one line, at most :data:`MAX_CAUSE` characters."""
    text = " ".join(str(cause).split())
    return text if len(text) <= MAX_CAUSE else text[: MAX_CAUSE - 3] + "..."


def cause_of(result: Shareable) -> str:
    """What a non-OK ``result`` says went wrong: its return code and, when it carries one, its cause."""
    rc = result.get_return_code(ReturnCode.OK)
    cause = result.get_header(CAUSE_HEADER)
    return f"{rc}: {one_line_cause(cause)}" if isinstance(cause, str) and cause else str(rc)


class MissingSites:
    """The causes of the sites whose result was not OK in the current round (reset at each round)."""

    def __init__(self):
        self.causes: dict[str, str] = {}

    def reset(self) -> None:
        self.causes = {}

    def note(self, site: str, result: Shareable) -> None:
        """Record ``site``'s cause when ``result`` is an error reply."""
        if result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            self.causes[site] = cause_of(result)

    def describe(self, sites: Iterable[str]) -> str:
        """``site (cause); ...`` for ``sites``; a site that sent nothing at all is "no reply (timed out or gone)"."""
        return "; ".join(f"{s} ({self.causes.get(s, 'no reply: timed out or gone')})" for s in sorted(sites))
