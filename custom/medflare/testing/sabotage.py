"""A site whose data file goes bad in the middle of a job, for tests: a client task data filter that damages one file.

Put it in the client config's ``task_data_filters`` (``customize_job(task_data_filters=[{"tasks": ["train"],
"filters": [{"path": "medflare.testing.sabotage.DamageFileFilter", "args": {"site": "site-3", "path": FILE,
"at_round": 1}}]}])``): every site runs it, only ``site`` acts, once, just before its executor sees the
``at_round``-th task (0-based, counted per task name), i.e. between two rounds as a disk failure or an operator's
mistake would. It is how the reliability tests show that such a site fails its task with the file named and the job
goes on with the others (tests/e2e/test_bad_file_mid_job.py). Never used by a job: the path is the test's own.
"""

from __future__ import annotations

from pathlib import Path

from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.testing.poison import TaskCounter

DAMAGES = ("delete", "truncate")


class DamageFileFilter(Filter):
    """Client task data filter: ``site`` deletes ``path`` (``damage="delete"``) or cuts it to its first 40 bytes
    (``"truncate"``) when its ``at_round``-th task (default 1) arrives. Args: site, path, at_round, damage."""

    def __init__(self, site: str, path: str, at_round: int = 1, damage: str = "delete"):
        super().__init__()
        if damage not in DAMAGES:
            raise ConfigError(f"DamageFileFilter: damage must be one of {DAMAGES}, got '{damage}'")
        keep_args(self, site=site, path=path, at_round=at_round, damage=damage)
        self.counter = TaskCounter()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        task, rnd = self.counter.next(fl_ctx)
        if fl_ctx.get_identity_name() == self.site and rnd == self.at_round:
            target = Path(self.path)
            if self.damage == "delete":
                target.unlink()
            else:
                target.write_bytes(target.read_bytes()[:40])
            self.log_warning(fl_ctx, f"test sabotage: {self.damage}d '{target}' before task {rnd} of '{task}' of {self.site}")
        return shareable
