"""Run a shipped job: export it from its recipe (:mod:`.export`), copy it with settings changed (:mod:`.customize`),
run it in the FLARE simulator and read back what it wrote (:mod:`.simulate`), and record what its sites sent
(:mod:`.egress`). ``medflare report``, the benchmarks and the tests share this tooling; nothing here is imported at a
site except :class:`medflare.jobs.egress.EgressRecorder`, which a run adds to its own copy of a job."""
