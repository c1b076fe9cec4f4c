"""Load and soak figures for `sandbox-kernel serve` (loopback only, every run bounded).

`python -m bench.load --scenario mixed|soak|faults|fuzz|all [--quick]` runs the harness of
tests/load (mixed, faults, fuzz) at full size and the soak scenario here, on the real service on
127.0.0.1, and writes `bench/results/load.md` and `bench/results/load.png`.
"""
