"""What only tests use: widgets that record what a workflow did (:mod:`.widgets`), poisoned and sabotaged sites
(:mod:`.poison`, :mod:`.sabotage`), hospital-like data files (:mod:`.hospital_data`). No runtime module imports it;
the tooling that exports, customises and runs a job lives in :mod:`medflare.jobs`."""
