"""The service's settings: traitlets read from dify-sandbox's environment variables and from flags.

Each setting carries an `env` tag (the variable dify-sandbox operators already set, where there is
one) and a `flag` tag (its `sandbox-kernel serve` option). A flag beats the variable, which beats
the default. This module imports nothing heavy, so `sandbox-kernel --help` works without the
`[server]` extra.
"""

from __future__ import annotations

import argparse
import os
from typing import Any
from urllib.parse import urlsplit

from traitlets import Bool, Enum, Float, Int, TraitError, Unicode
from traitlets.config import Configurable

from .. import flags
from ..hosting import keys as auth
from ..hosting.oneshots import DEFAULT_MAX_PRELOADED
from ..launch.forkserver.pools import PROCESSES
from ..launch.oneshot import DEFAULT_ONE_SHOT_POOL, DEFAULT_ONE_SHOT_PROCESS, PROCESS_VAR


class ServiceConfig(Configurable):
    """How `sandbox-kernel serve` listens, admits requests and bounds them."""

    host = Unicode(
        "0.0.0.0", help="Address to listen on.",
    ).tag(config=True, flag="host", env="SANDBOX_HOST", metavar="ADDR")

    port = Int(
        8194, help="Port to listen on (dify-sandbox's SANDBOX_PORT).",
    ).tag(config=True, flag="port", env="SANDBOX_PORT", metavar="PORT")

    api_key = Unicode(
        None, allow_none=True,
        help="The key the dify-sandbox routes expect in X-Api-Key (dify-sandbox's API_KEY), at "
        "least 16 characters. Without --api-keys-file it is also the native API's one bearer "
        "key, id 'default'. Unset: dify-sandbox's public default 'dify-sandbox' (warned at "
        "start), or, with --api-keys-file, the dify-sandbox routes are off.",
    ).tag(config=True, flag="api-key", env="API_KEY", metavar="KEY")

    api_keys_file = Unicode(
        "",
        help="JSON file of the native API's bearer keys: "
        '{"keys": [{"id": "team-a", "key": "...", "max_sessions": 4}]}; max_sessions optional.',
    ).tag(config=True, flag="api-keys-file", env="SANDBOX_API_KEYS_FILE", metavar="FILE")

    max_workers = Int(
        4, help="Runs executing at once; the rest wait in line (dify-sandbox's MAX_WORKERS).",
    ).tag(config=True, flag="max-workers", env="MAX_WORKERS", metavar="N")

    max_requests = Int(
        50, help="Runs in flight (running or waiting) before new ones get 503 at once "
        "(dify-sandbox's MAX_REQUESTS).",
    ).tag(config=True, flag="max-requests", env="MAX_REQUESTS", metavar="N")

    max_workers_per_key = Int(
        None, allow_none=True,
        help="Runs one tenant (a native API key, or the dify routes) may have executing at once. "
        "Unset: all of --max-workers while one tenant exists, else half, rounded up.",
    ).tag(config=True, flag="max-workers-per-key", env="SANDBOX_MAX_WORKERS_PER_KEY",
          metavar="N")

    max_requests_per_key = Int(
        None, allow_none=True,
        help="Runs one tenant may have in flight (running or waiting) before its new ones get "
        "503. Unset: all of --max-requests while one tenant exists, else half, rounded up.",
    ).tag(config=True, flag="max-requests-per-key", env="SANDBOX_MAX_REQUESTS_PER_KEY",
          metavar="N")

    worker_timeout = Float(
        5.0, help="Seconds one stateless run may take (dify-sandbox's WORKER_TIMEOUT); also the "
        "default of the native API's /execute on a fresh kernel.",
    ).tag(config=True, flag="worker-timeout", env="WORKER_TIMEOUT", metavar="SECONDS")

    session_timeout = Float(
        60.0, help="Default seconds one execution (or package install) in a session may take; "
        "a request's own timeout overrides it, up to --max-timeout. Sessions do interactive "
        "work (a first matplotlib import, a model's analysis), hence longer than "
        "--worker-timeout.",
    ).tag(config=True, flag="session-timeout", env="SANDBOX_SESSION_TIMEOUT",
          metavar="SECONDS")

    nodejs_upstream = Unicode(
        "", help="URL of a dify-sandbox kept for JavaScript (e.g. http://sandbox:8194): "
        "/v1/sandbox/run requests with language nodejs are forwarded to it unchanged (body and "
        "X-Api-Key) and its answer returned as it is. Empty: such requests get code -400 with a "
        "message naming this option, which Dify shows as the node's error.",
    ).tag(config=True, flag="nodejs-upstream", env="SANDBOX_NODEJS_UPSTREAM", metavar="URL")

    runtime = Unicode(
        "", help="The runtime (`sandbox-kernel runtime create NAME`) kernels run on; its "
        "packages are what the dify routes' /dependencies list. Empty: this interpreter's.",
    ).tag(config=True, flag="runtime", env="SANDBOX_RUNTIME", metavar="NAME")

    max_timeout = Float(
        300.0, help="The longest timeout a native API request may ask for.",
    ).tag(config=True, flag="max-timeout", env="SANDBOX_MAX_TIMEOUT", metavar="SECONDS")

    enable_network = Bool(
        True, help="Whether a run may ask for network access (dify-sandbox's ENABLE_NETWORK). "
        "Off: requests with enable_network get code -400 and only network-less kernels start.",
    ).tag(config=True, flag="enable-network", env="ENABLE_NETWORK")

    socks5_proxy = Unicode(
        "", help="Proxy URL set as HTTPS_PROXY and HTTP_PROXY in network kernels, as "
        "dify-sandbox does with SOCKS5_PROXY (needs a SOCKS-capable HTTP library in the image).",
    ).tag(config=True, flag="socks5-proxy", env="SOCKS5_PROXY", metavar="URL")

    https_proxy = Unicode(
        "", help="HTTPS_PROXY for network kernels (when --socks5-proxy is not set), e.g. the "
        "platform's SSRF proxy.",
    ).tag(config=True, flag="https-proxy", env="HTTPS_PROXY", metavar="URL")

    http_proxy = Unicode(
        "", help="HTTP_PROXY for network kernels (when --socks5-proxy is not set).",
    ).tag(config=True, flag="http-proxy", env="HTTP_PROXY", metavar="URL")

    pool_size = Int(
        1, help="Started kernels kept ready per network policy, so a run does not wait for a "
        "kernel to start; 0 starts each on demand.",
    ).tag(config=True, flag="pool-size", env="SANDBOX_POOL_SIZE", metavar="N")

    one_shot_pool_size = Int(
        DEFAULT_ONE_SHOT_POOL, help="One-shot kernels kept confined and waiting per network "
        "policy for stateless runs (the dify route, the native one-shot execute), each used "
        "for exactly one run; 0 runs them on fresh ZMQ kernels from --pool-size's pools.",
    ).tag(config=True, flag="one-shot-pool-size", env="SANDBOX_ONE_SHOT_POOL_SIZE", metavar="N")

    one_shot_process = Enum(
        list(PROCESSES), DEFAULT_ONE_SHOT_PROCESS, help="The process a stateless run gets: "
        "'shell', the lean one (IPython's shell, in a zygote of its own: no ipykernel, ZMQ or "
        "jupyter_client in its image); 'kernel', the ipykernel one-shot kernel, kept one "
        "release as a fallback (docs/architecture.md).",
    ).tag(config=True, flag="one-shot-process", env=PROCESS_VAR, metavar="PROCESS")

    max_preload_pools = Int(
        DEFAULT_MAX_PRELOADED, help="On a --runtime that preloads modules: one-shot pools whose "
        "zygote holds a set of them (chosen per run from the modules its code imports) alive "
        "at once, the least recently used retired to make room; runs importing none of them, "
        "or whose set has no pool, take the lean pool. Each costs its fork server, its zygote "
        "and --one-shot-pool-size processes (docs/deploy.md); 0: every run on the lean pool.",
    ).tag(config=True, flag="max-preload-pools", env="SANDBOX_MAX_PRELOAD_POOLS", metavar="N")

    max_sessions = Int(
        32, help="Sessions open at once over all keys; each holds a kernel.",
    ).tag(config=True, flag="max-sessions", env="SANDBOX_MAX_SESSIONS", metavar="N")

    max_sessions_per_key = Int(
        None, allow_none=True,
        help="Sessions one API key may hold, unless its entry in the keys file sets "
        "max_sessions. Unset: all of --max-sessions while one key exists, else half, rounded "
        "up.",
    ).tag(config=True, flag="max-sessions-per-key", env="SANDBOX_MAX_SESSIONS_PER_KEY",
          metavar="N")

    session_idle_timeout = Float(
        600.0, help="Default seconds a session may sit idle before its kernel is shut down.",
    ).tag(config=True, flag="session-idle-timeout", env="SANDBOX_SESSION_IDLE_TIMEOUT",
          metavar="SECONDS")

    max_session_idle_timeout = Float(
        3600.0, help="The longest idle timeout a session may ask for.",
    ).tag(config=True, flag="max-session-idle-timeout", env="SANDBOX_MAX_SESSION_IDLE_TIMEOUT",
          metavar="SECONDS")

    state_dir = Unicode(
        "", help="Directory of sealed snapshots and paused sessions (the service's own MAC key "
        "is made in it, 0600); instances sharing it resume each other's paused sessions. "
        "Empty: snapshots and pausing are off.",
    ).tag(config=True, flag="state-dir", env="SANDBOX_STATE_DIR", metavar="DIR")

    max_snapshot_size = Int(
        1024 * 2**20, help="Largest snapshot (sealed bytes) the state dir keeps; a larger one "
        "is refused with 413 and the session keeps running.",
    ).tag(config=True, flag="max-snapshot-size", env="SANDBOX_MAX_SNAPSHOT_SIZE",
          metavar="BYTES")

    max_snapshots_per_key = Int(
        64, help="Snapshots one API key keeps in --state-dir (those it made; a paused session "
        "is bounded by the key's session limit instead); past it, a new one is refused with "
        "429 until one is deleted.",
    ).tag(config=True, flag="max-snapshots-per-key", env="SANDBOX_MAX_SNAPSHOTS_PER_KEY",
          metavar="N")

    max_snapshot_bytes_per_key = Int(
        8 * 2**30, help="Bytes one API key's snapshots in --state-dir may hold in all; a "
        "snapshot that does not fit is refused with 413 (before its bytes leave the kernel "
        "when it says its size) and the session keeps running.",
    ).tag(config=True, flag="max-snapshot-bytes-per-key",
          env="SANDBOX_MAX_SNAPSHOT_BYTES_PER_KEY", metavar="BYTES")

    session_pause_after = Float(
        0.0, help="Seconds a session may sit idle before it is snapshotted into --state-dir and "
        "its kernel stopped; its next request resumes it on a fresh kernel. 0: never (idle "
        "sessions keep their kernel until --session-idle-timeout).",
    ).tag(config=True, flag="session-pause-after", env="SANDBOX_SESSION_PAUSE_AFTER",
          metavar="SECONDS")

    max_body_bytes = Int(
        16 * 2**20, help="Largest request body accepted; larger ones get 413.",
    ).tag(config=True, flag="max-body", env="SANDBOX_MAX_BODY", metavar="BYTES")

    max_file_bytes = Int(
        8 * 2**20, help="Largest file a session may upload or download.",
    ).tag(config=True, flag="max-file", env="SANDBOX_MAX_FILE", metavar="BYTES")

    max_output_total = Int(
        16 * 2**20, help="Most bytes of output (streams and displays) the service takes from "
        "one execution, whatever the kernel's own --max-output says; past it the run ends.",
    ).tag(config=True, flag="max-output-total", env="SANDBOX_MAX_OUTPUT_TOTAL", metavar="BYTES")

    instance_id = Unicode(
        "", help="The prefix of this instance's run ids, which another instance names in "
        "its 409 to an answer for a tool call of them (empty: a random id at start).",
    ).tag(config=True, flag="instance-id", env="SANDBOX_INSTANCE_ID", metavar="ID")

    max_tool_timeout = Float(
        60.0, help="Seconds the service waits at most for the caller's answer to a tool call "
        "of a run (a run's tool_timeout asks for less).",
    ).tag(config=True, flag="max-tool-timeout", env="SANDBOX_MAX_TOOL_TIMEOUT", metavar="S")

    kernel_grace = Float(
        2.0, help="Seconds past its timeout a kernel gets to stop by itself before the service "
        "interrupts it (sessions) or discards it (stateless runs).",
    ).tag(config=True, flag="kernel-grace", env="SANDBOX_KERNEL_GRACE", metavar="SECONDS")

    shutdown_grace = Float(
        10.0, help="Seconds in-flight runs get to finish at shutdown before they are cancelled.",
    ).tag(config=True, flag="shutdown-grace", env="SANDBOX_SHUTDOWN_GRACE", metavar="SECONDS")

    head_timeout = Float(
        10.0, help="Seconds a new connection has to send a whole request head before it is "
        "closed (slow or silent clients cost a bounded time).",
    ).tag(config=True, flag="head-timeout", env="SANDBOX_HEAD_TIMEOUT", metavar="SECONDS")

    max_idle_connections = Int(
        512, help="Open connections not in a request kept at most; past it the oldest idle ones "
        "are closed, so idle connections never take the place of requests.",
    ).tag(config=True, flag="max-idle-connections", env="SANDBOX_MAX_IDLE_CONNECTIONS",
          metavar="N")

    log_level = Unicode(
        "info", help="Log level of the service's own log lines.",
    ).tag(config=True, flag="log-level", env="SANDBOX_LOG_LEVEL", metavar="LEVEL")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Variables whose empty value is a mistake to refuse, not the same as leaving them unset: an
# empty API_KEY once fell back to the public default key.
EMPTY_IS_A_VALUE = ("API_KEY",)


def _from_env(name: str, trait: Any, text: str) -> Any:
    if isinstance(trait, Bool):
        if text.strip().lower() in _TRUE:
            return True
        if text.strip().lower() in _FALSE:
            return False
        raise TraitError(f"{name}={text!r}: expected true or false")
    try:
        return trait.from_string(text.strip())
    except (TraitError, ValueError) as exc:
        raise TraitError(f"{name}={text!r}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags: every ServiceConfig setting, then the flags of every face's kernels."""
    group = parser.add_argument_group("service")
    for name, trait in ServiceConfig.class_traits(config=True).items():
        option = f"--{trait.metadata['flag']}"
        env = trait.metadata.get("env")
        help_text = trait.help + (f" Env: {env}." if env else "")
        if isinstance(trait, Bool):
            group.add_argument(option, dest=f"service_{name}",
                               action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(option, dest=f"service_{name}", default=None,
                               metavar=trait.metadata.get("metavar"), help=help_text)
    flags.add_arguments(parser, start_up=False)


def from_arguments(args: argparse.Namespace, environ: dict[str, str] | None = None
                   ) -> ServiceConfig:
    """Settings from flags, then the environment, then the defaults. Raises TraitError."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for name, trait in ServiceConfig.class_traits(config=True).items():
        given = getattr(args, f"service_{name}", None)
        env = trait.metadata.get("env")
        if given is not None:
            values[name] = given if isinstance(given, bool) else _from_env(
                f"--{trait.metadata['flag']}", trait, given)
        elif env and environ.get(env, "").strip():
            values[name] = _from_env(env, trait, environ[env])
        elif env in EMPTY_IS_A_VALUE and env in environ:
            values[name] = ""  # refused by check(), not read as unset
    if "session_timeout" not in values and "max_timeout" in values:
        # Unset, the sessions' default never exceeds the longest timeout a request may ask.
        values["session_timeout"] = min(ServiceConfig.session_timeout.default_value,
                                        values["max_timeout"])
    config = ServiceConfig(**values)
    check(config)
    return config


def check(config: ServiceConfig) -> None:
    """Refuse settings that cannot work, naming the setting."""
    positive = ("max_workers", "max_requests", "worker_timeout", "session_timeout",
                "max_timeout", "max_sessions",
                "max_body_bytes", "max_file_bytes", "max_output_total", "head_timeout",
                "max_idle_connections", "max_snapshot_size", "max_snapshots_per_key",
                "max_snapshot_bytes_per_key")
    for name in positive:
        if getattr(config, name) <= 0:
            raise TraitError(f"{name.replace('_', '-')} must be positive, "
                             f"got {getattr(config, name)}")
    for name in ("max_workers_per_key", "max_requests_per_key", "max_sessions_per_key"):
        if getattr(config, name) is not None and getattr(config, name) <= 0:
            raise TraitError(f"{name.replace('_', '-')} must be positive, "
                             f"got {getattr(config, name)}")
    for name in ("pool_size", "one_shot_pool_size", "max_preload_pools", "kernel_grace",
                 "shutdown_grace",
                 "session_idle_timeout", "session_pause_after"):
        if getattr(config, name) < 0:
            raise TraitError(f"{name.replace('_', '-')} must not be negative")
    if config.session_pause_after and not config.state_dir:
        raise TraitError("session-pause-after needs --state-dir: a paused session's snapshot "
                         "is kept there")
    if config.session_timeout > config.max_timeout:
        raise TraitError(f"session-timeout {config.session_timeout:g} s is above max-timeout "
                         f"{config.max_timeout:g} s: lower it or raise --max-timeout")
    if config.nodejs_upstream:
        parts = urlsplit(config.nodejs_upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TraitError(f"nodejs-upstream {config.nodejs_upstream!r}: expected an http:// "
                             "or https:// URL of a dify-sandbox, e.g. http://sandbox:8194")
    if not 0 < config.port < 65536:
        raise TraitError(f"port must be 1-65535, got {config.port}")
    try:
        auth.check_dify_key(config.api_key)
    except ValueError as exc:
        raise TraitError(str(exc)) from None
    if config.enable_network:
        upstream_proxy(config)  # refuses what the egress proxy cannot chain to


def upstream_proxy(config: ServiceConfig) -> str:
    """The proxy the kernels' egress proxy chains to: the deployment's HTTPS_PROXY, else its
    HTTP_PROXY (dify-sandbox's variables; user code itself always sees the egress proxy)."""
    if config.socks5_proxy:
        raise TraitError("SOCKS5_PROXY: the egress proxy chains to an HTTP proxy only; give "
                         "the deployment's HTTP proxy as HTTPS_PROXY / --https-proxy instead")
    url = config.https_proxy or config.http_proxy
    if url:
        from ..confine.egress.rules import Upstream

        try:
            Upstream.parse(url)
        except ValueError as exc:
            raise TraitError(f"HTTPS_PROXY / HTTP_PROXY: {exc}") from None
    return url
