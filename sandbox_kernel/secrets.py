"""Declaring secrets: credentials user code may use but never hold; where their values come from.

A secret is declared by name and hosts (`--secret NAME=HOST`, repeated for more hosts, as
--allow-host): that is all the policy carries, because the policy goes into kernels' argv and
kernelspecs. Its value is the launcher's environment variable NAME, or NAME's entry in
`--secrets-file FILE` (JSON `{"NAME": {"value": ..., "hosts": [...]}}`, readable by its owner
only). At each start the launcher (launch/provisioner.py) resolves the values, makes each
secret's placeholder (what user code finds in os.environ[NAME]) and seals both into the
kernel's vault (confine/vault.py), which only the kernel's companion reads: its egress proxy
adds the value to requests for the secret's hosts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from traitlets import TraitError

from .confine.egress.secret import Secret
from .confine.environment import PASSED_THROUGH, PROXY_VARIABLES, acts_on_start

PLACEHOLDER_PREFIX = "sk-sandbox-"
# Per launcher process: placeholders are unique per session and secret, and the same for a
# restarted kernel of the session (same kernel id), yet no one can compute another's.
_PLACEHOLDER_KEY = os.urandom(32)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
WHERE_VALUES_COME_FROM = ("a secret's value is never given on the command line (argv and "
                          "kernelspecs are readable): set it in the launcher's environment "
                          "variable NAME, or give it in --secrets-file FILE")


class SecretError(TraitError):
    """A secret that cannot be declared or delivered; the message names the fix.

    A TraitError: every face reports a policy it cannot use so already.
    """


def parse_declaration(entry: str) -> tuple[str, str]:
    """`NAME=HOST` -> (NAME, HOST); SecretError (never quoting a value) otherwise."""
    from .confine.egress import rules

    name, sep, host = entry.partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise SecretError(f"--secret expects NAME=HOST (an environment variable name and a "
                          f"host user code sends it to); {WHERE_VALUES_COME_FROM}")
    check_name(name)
    try:
        rules.parse_host_entry(host)
    except rules.RuleError:
        # Most likely the value itself: never repeat it (it would reach logs and terminals).
        raise SecretError(f"--secret {name}=...: the right-hand side is not a host name "
                          f"(api.example.com, *.example.com, HOST:PORT); "
                          f"{WHERE_VALUES_COME_FROM}") from None
    return name, host.strip()


# Variables the sandbox sets for user code itself: a placeholder there would break the kernel
# (its proxy settings, HOME, PATH), not stand for a credential.
SANDBOX_SET = frozenset({*PROXY_VARIABLES, "NO_PROXY", "no_proxy", "PATH", "HOME", "TMPDIR",
                         "IPYTHONDIR", "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                         *PASSED_THROUGH})


def check_name(name: str) -> None:
    """A secret's name must be a variable user code can be given (not one the loader acts on,
    nor one the sandbox sets itself)."""
    if not _NAME.match(name) or acts_on_start(name) or name in SANDBOX_SET:
        raise SecretError(f"secret {name[:64]!r}: not a name a secret can have (an environment "
                          "variable name that neither the dynamic loader nor the interpreter "
                          "acts on, and not one the sandbox sets: proxies, PATH, HOME, locale)")


def declared(entries: Sequence[str]) -> dict[str, list[str]]:
    """--secret entries by name: {NAME: [HOST, ...]}."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        name, host = parse_declaration(entry)
        found.setdefault(name, []).append(host)
    return found


def read_file(path: str) -> dict[str, dict[str, Any]]:
    """A --secrets-file: {NAME: {"value": str, "hosts": [str, ...]}}, checked.

    Refused unless only its owner may read it (mode 0600 or stricter): the values in it are
    what the whole feature keeps from everyone else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretError(f"--secrets-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        refused = readable_by_others(fd, f"--secrets-file {path}", path)
        if refused:
            raise SecretError(refused)
        try:
            contents = json.loads(file.read(1 << 20))
        except ValueError:
            raise SecretError(f"--secrets-file {path}: not JSON") from None
    return checked_entries(contents, f"--secrets-file {path}")


def readable_by_others(fd: int, what: str, path: str) -> str | None:
    """Why the open file fd (what: how the message names it) may not hold secrets, or None.

    A file of secrets (--secrets-file, an API keys file) must be a regular file only its owner
    may read or write: mode 0600 or stricter.
    """
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) and not mode & 0o077:
        return None
    return (f"{what}: mode {stat.S_IMODE(mode):04o} lets others read it; make it readable by "
            f"its owner only (chmod 600 {path})")


def checked_entries(contents: Any, where: str) -> dict[str, dict[str, Any]]:
    """{NAME: {"value": str, "hosts": [str, ...]}} as given (a file, a session), checked.

    Errors name the entry, never its value.
    """
    from .confine.egress import rules

    if not isinstance(contents, dict):
        raise SecretError(f'{where}: expected {{"NAME": {{"value": "...", "hosts": [...]}}}}')
    entries = {}
    for name, entry in contents.items():
        check_name(str(name))
        value = entry.get("value") if isinstance(entry, dict) else None
        hosts = entry.get("hosts") if isinstance(entry, dict) else None
        if not isinstance(value, str) or not value or not isinstance(hosts, list) or not hosts \
                or not all(isinstance(host, str) for host in hosts):
            raise SecretError(f'{where}: secret {name}: expected {{"value": "...", "hosts": '
                              '["api.example.com", ...]}')
        for host in hosts:
            try:
                rules.parse_host_entry(host)
            except rules.RuleError as exc:
                raise SecretError(f"{where}: secret {name}: {exc}") from None
        entries[name] = {"value": value, "hosts": list(hosts)}
    return entries


def check_reachable(hosts_by_name: Mapping[str, Sequence[str]], network: str,
                    allow_hosts: Sequence[str], allow_addresses: Sequence[str]) -> None:
    """Every secret's hosts must be reachable under the network policy; else SecretError."""
    if not hosts_by_name:
        return
    from .confine.egress import rules

    if network == "off":
        name, hosts = next(iter(hosts_by_name.items()))
        raise SecretError(f"secret {name} is for {', '.join(hosts)}, but the network is off "
                          f"(--network off): start the kernel with --network hosts "
                          f"--allow-host {hosts[0]}, or drop the secret")
    policy = rules.EgressRules.parse(network, list(allow_hosts), list(allow_addresses),
                                     is_own=lambda _: False)
    for name, hosts in hosts_by_name.items():
        for host in hosts:
            if policy.check_name(*_probe(host)) is not None:
                raise SecretError(f"secret {name} is for {host}, which the network policy does "
                                  f"not reach (--network {network}, --allow-host "
                                  f"{', '.join(allow_hosts) or 'none'}): "
                                  + _reach_advice(name, host, allow_hosts))


def _reach_advice(name: str, host: str, allow_hosts: Sequence[str]) -> str:
    """What makes a secret's host reachable: the port an --allow-host of its name grants
    (narrower than granting the host on every port), else that --allow-host."""
    from .confine.egress import rules

    rule = rules.parse_host_entry(host)
    if isinstance(rule, rules.NameRule) and rule.port is None:
        for entry in allow_hosts:
            allowed = rules.parse_host_entry(entry)
            if isinstance(allowed, rules.NameRule) and allowed.port is not None \
                    and (allowed.name, allowed.wildcard) == (rule.name, rule.wildcard):
                return (f"{host} without a port is every port of it, and --allow-host grants "
                        f"one: name that port, --secret {name}={entry.strip()}")
    return f"add --allow-host {host}, or drop the secret's host"


def _probe(host: str) -> tuple[str, int]:
    """A name and port a secret's host entry stands for (a wildcard: a name below it)."""
    from .confine.egress import rules

    rule = rules.parse_host_entry(host)
    if isinstance(rule, rules.NetRule):
        address = rule.network.network_address
        return str(address), rule.port or 443
    return (f"sandbox-probe.{rule.name}" if rule.wildcard else rule.name), rule.port or 443


def placeholder(session: str, name: str) -> str:
    """What user code sees in os.environ[name]: unique per session and secret, not the value."""
    digest = hmac.new(_PLACEHOLDER_KEY, f"{session}\0{name}".encode(), hashlib.sha256)
    return f"{PLACEHOLDER_PREFIX}{name}-{digest.hexdigest()[:32]}"


def resolve(entries: Sequence[str], secrets_file: str, env: Mapping[str, str],
            session: str) -> tuple[Secret, ...]:
    """The secrets a policy declares, with their values (file first, else env) and placeholders.

    A name declared on the command line takes its value from the secrets file when the file
    has it, else from env (the launcher's environment); the file's own entries come with
    their hosts. SecretError when a declared secret has no value.
    """
    hosts = declared(entries)
    given = read_file(secrets_file) if secrets_file else {}
    for name, entry in given.items():
        hosts.setdefault(name, [])
        hosts[name] += [host for host in entry["hosts"] if host not in hosts[name]]
    found = []
    for name, names_hosts in hosts.items():
        value = given[name]["value"] if name in given else env.get(name, "")
        if not value:
            raise SecretError(f"secret {name} has no value: set the launcher's environment "
                              f"variable {name}, or give it in --secrets-file")
        found.append(Secret(name, value, tuple(names_hosts), placeholder(session, name)))
    return tuple(found)


def vault_contents(secrets: Sequence[Secret], upstream_proxy: str = "") -> dict[str, Any]:
    """What the launcher seals for the kernel's companion (confine/vault.py)."""
    return {"secrets": [{"name": secret.name, "value": secret.value,
                         "hosts": list(secret.hosts), "placeholder": secret.placeholder}
                        for secret in secrets],
            "upstream_proxy": upstream_proxy}


# The upstream proxy's credentials (`--upstream-proxy http://user:pass@proxy:8080`) are the
# companion's too: a kernel's argv and kernelspec name the proxy without them, and the launcher
# seals the whole URL into the vault. A launcher that started from a kernelspec finds it in its
# environment (UPSTREAM_VAR); one that was given the flag remembers it (policy.to_argv).
UPSTREAM_VAR = "SANDBOX_UPSTREAM_PROXY"
_UPSTREAMS: dict[str, str] = {}  # the URL without credentials -> with them


def without_credentials(url: str) -> str:
    """url without its userinfo (what a kernel may know of its upstream proxy)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc))


def remember_upstream(url: str) -> str:
    """url without credentials, which kernels this process starts get back in their vault."""
    bare = without_credentials(url)
    if bare != url:
        _UPSTREAMS[bare] = url
    return bare


def upstream_with_credentials(url: str, env: Mapping[str, str]) -> str:
    """The upstream proxy a kernel's policy names, with the credentials the launcher knows."""
    if not url:
        return ""
    given = env.get(UPSTREAM_VAR, "")
    if given and without_credentials(given) == url:
        return given
    return _UPSTREAMS.get(url, url)


_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}\Z")


def check_index(url: str) -> None:
    """A package index URL may carry credentials only as secrets' names: `${TOKEN}`.

    A literal token in it would be in the kernel's argv and memory, where user code reads it.
    """
    # Not urlsplit's netloc: a token with a "/" in it would end the netloc early and hide.
    userinfo, at, _ = url.partition("://")[2].rpartition("@")
    if not at:
        return
    if all(_REFERENCE.match(part) for part in userinfo.split(":")):
        return
    raise SecretError("--package-index: its credentials would be readable by user code; "
                      "declare the token as a secret and name it in the URL: --secret "
                      "TOKEN=INDEX-HOST --package-index 'https://${TOKEN}@INDEX-HOST/simple' "
                      "(in single quotes, so the shell leaves ${TOKEN} alone)")


def seal_for(policy: Any, env: dict[str, str], session: str
             ) -> tuple[list[str], int | None]:
    """Launcher side, at a kernel's start: its placeholders (argv options) and vault (an fd).

    policy: the kernel's SandboxPolicy (policy.from_kernel_argv: this module sits below
    policy.py, which checks secrets with it); env: the environment the kernel is started
    with, where the values are found and from which they are taken out (with any vault named
    there: only the one made here is the kernel's). (No options, None) when the policy holds
    no credentials. The placeholders are the policy's env, set once user code is confined.
    """
    from .confine import vault

    env.pop(vault.VAULT_VAR, None)
    upstream = upstream_with_credentials(policy.upstream_proxy, env)
    if not (policy.secrets or policy.secrets_file or upstream != policy.upstream_proxy):
        return [], None
    held = resolve(policy.secrets, policy.secrets_file, env, session)
    check_reachable({secret.name: secret.hosts for secret in held}, policy.network,
                    policy.allow_hosts, policy.allow_addresses)
    for secret in held:
        env.pop(secret.name, None)
    options = [f"--SandboxPolicy.env={secret.name}={secret.placeholder}" for secret in held]
    return options, vault.seal(vault_contents(held, upstream))
