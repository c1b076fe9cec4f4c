"""Benchmarks: what the sandbox costs, against plain ipykernel and a process per request.

Run `python -m bench` (add `--quick` for a smoke run); see bench/results/latest.md.
"""
