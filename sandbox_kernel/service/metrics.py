"""Prometheus metrics of one service instance (its own registry, so apps do not share counters)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BYTES = tuple(float(2**n) for n in range(10, 34, 2))  # 1 KiB .. 8 GiB, by fours
# Each execution's usage (client.Usage), measured from outside the kernel where it is local.
_USAGE = (
    ("wall_seconds", "Wall time of one execution, by API.", _SECONDS),
    ("cpu_seconds", "CPU (user + system) the kernel used in one execution, by API.", _SECONDS),
    ("peak_memory_bytes", "The kernel's peak memory during one execution, by API.", _BYTES),
    ("output_bytes", "Bytes of stream output one execution wrote, by API.", _BYTES),
    ("result_bytes", "Bytes of one execution's result, by API.", _BYTES),
    ("refused_syscalls", "System calls the filter refused in one execution, by API.",
     (0, 1, 2, 5, 10, 100, 1000)),
)


class Metrics:
    """The service's counters, histograms and gauges."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sandbox_requests", "HTTP requests answered, by route template and status.",
            ["route", "status"], registry=self.registry)
        self.duration = Histogram(
            "sandbox_request_duration_seconds", "Time to answer a request, by route template.",
            ["route"], registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
        self.denials = Counter(
            "sandbox_denials", "Requests refused before running: bad key, too many requests, "
            "session limit, bad input, body too large.", ["reason"], registry=self.registry)
        self.snapshots_refused = Counter(
            "sandbox_snapshots_refused", "Snapshots and pauses refused, by reason: size (past "
            "--max-snapshot-size), key_count and key_bytes (past the key's quota, "
            "--max-snapshots-per-key and --max-snapshot-bytes-per-key).", ["reason"],
            registry=self.registry)
        self.runs = Counter(
            "sandbox_runs", "Executions finished, by API and outcome (ok, error, timeout, "
            "lost).", ["api", "outcome"], registry=self.registry)
        self.kernels_live = Gauge(
            "sandbox_kernels_live", "Kernels handed out: running a stateless run or held by a "
            "session.", registry=self.registry)
        self.kernels_pooled = Gauge(
            "sandbox_kernels_pooled", "Started kernels waiting in the pool, by network policy.",
            ["policy"], registry=self.registry)
        self.sessions = Gauge(
            "sandbox_sessions", "Sessions open.", registry=self.registry)
        self.in_flight = Gauge(
            "sandbox_runs_in_flight", "Stateless runs running or waiting for a worker.",
            registry=self.registry)
        self.tool_calls = Counter(
            "sandbox_tool_calls", "Tool calls runs made (counted when the run ends), by API "
            "and outcome (ok, error, refused, timeout, abandoned).", ["api", "outcome"],
            registry=self.registry)
        self.tool_call_seconds = Histogram(
            "sandbox_tool_call_seconds", "Time from a tool call to its answer, by API and "
            "outcome.", ["api", "outcome"], registry=self.registry, buckets=_SECONDS)
        self.usage = {
            figure: Histogram(f"sandbox_execution_{figure}", help_text, ["api"],
                              registry=self.registry, buckets=buckets)
            for figure, help_text, buckets in _USAGE}
        self._pooled: Callable[[], dict[str, int]] = dict
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def labelled(self, metric: Any, *values: str) -> Any:
        """metric.labels(*values) (in its label names' order), kept for the next request:
        prometheus_client checks and sorts the labels on every call, a tenth of the cost of
        answering a request's log line and counters. Label values are bounded (route
        templates, statuses, APIs, outcomes), so the cache is too."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_usage(self, api: str, usage: Any) -> None:
        """One execution's cost (client.Usage) in the usage histograms; unmeasured ones skipped."""
        cpu = None if usage.cpu_user_seconds is None or usage.cpu_system_seconds is None \
            else usage.cpu_user_seconds + usage.cpu_system_seconds
        for figure, value in (("wall_seconds", usage.wall_seconds), ("cpu_seconds", cpu),
                              ("peak_memory_bytes", usage.peak_memory_bytes),
                              ("output_bytes", usage.output_bytes),
                              ("result_bytes", usage.result_bytes),
                              ("refused_syscalls", usage.refused_syscalls)):
            if value is not None:
                self.labelled(self.usage[figure], api).observe(value)

    def observe_tool_calls(self, api: str, calls: Iterable[Any]) -> None:
        """One execution's tool calls (client.ToolCall) counted, and their durations."""
        for call in calls:
            self.tool_calls.labels(api=api, outcome=call.outcome).inc()
            self.tool_call_seconds.labels(api=api, outcome=call.outcome).observe(call.seconds)

    def bind(self, live: Callable[[], int], pooled: Callable[[], dict[str, int]],
             sessions: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """Read the gauges from the objects that know, at scrape time."""
        self.kernels_live.set_function(live)
        self.sessions.set_function(sessions)
        self.in_flight.set_function(in_flight)
        self._pooled = pooled

    def render(self) -> bytes:
        """The text exposition format."""
        for name, count in self._pooled().items():
            self.kernels_pooled.labels(policy=name).set(count)
        return generate_latest(self.registry)
