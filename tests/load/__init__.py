"""The load harness: start the real `sandbox-kernel serve` on 127.0.0.1, drive it, judge answers.

Scenarios 1 (mixed load: normal and hostile code nodes at a fixed concurrency), 3 (faults) and
4 (bad input, fuzzed from the OpenAPI schema) with the pieces they share: the service they start
(service.py), the HTTP driver (driver.py, native.py), the request kinds (workload.py), the verdict
on each answer (check.py), the service's processes and descriptors (resources.py), the stacks of a
service that stopped answering (watchdog.py) and what a run found (results.py).

tests/test_load.py runs them small; `python -m bench.load` (bench/load: the soak scenario, the
report and the chart) runs them at full size and keeps the figures. So the tests never import
bench, and bench only adds timing on top of this.
"""
