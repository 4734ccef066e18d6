"""`ingot bench`: latency, throughput and serving benchmarks of an engine, in-process.

points.py says what each mode measures, workload.py makes seeded workloads, ingot_driver.py
and hf_baseline.py run them (same `RunResult`), metrics.py and roofline.py turn runs into
figures, runner.py ties one invocation together and report.py writes JSON, markdown and PNG.
"""

from __future__ import annotations

from .points import GRIDS, MODES, Options
from .report import check_outputs, markdown, write_all
from .runner import SCHEMA, SCHEMA_VERSION, run_bench

__all__ = [
    "GRIDS",
    "MODES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Options",
    "check_outputs",
    "markdown",
    "run_bench",
    "write_all",
]
