"""``medflare report``: every algorithm and baseline on the same sites, the same scoring, side by side.

Modules: :mod:`traffic` (a FLARE filter that writes what crossed the wire, per site and round),
:mod:`methods` (the rows: which job, which preset, which result file), :mod:`runner` (one way to run a row
in the FLARE simulator and record it, reused by the benchmark scripts), :mod:`tables` and :mod:`figures`
(REPORT.md, CSV, JSON, PNG from the records). See docs/report.md.
"""
