"""Load, soak, fault and fuzz harness for `sandbox-kernel serve` (loopback only, every run bounded).

`python -m bench.load --scenario mixed|soak|faults|fuzz|all [--quick]` starts the real service on
127.0.0.1, drives it, and writes `bench/results/load.md` and `bench/results/load.png`.
"""
