"""The harness tests and benchmarks use to run jobs: copy a job folder with settings changed, run it in the
FLARE simulator, read back what it wrote. Never imported at a site: a site's installation runs only the
jobs' components."""
