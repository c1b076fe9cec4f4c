"""The sandbox policy: every knob a kernel is started with, as traitlets and as CLI flags.

Each configurable trait may carry a `flag` tag: the name of its command-line option, shared by
the kernel application (traitlets), `sandbox-kernel install` and `sandbox-kernel run` (argparse).
"""

from __future__ import annotations

import argparse
from typing import Any

from traitlets import Bool, Dict, Enum, Float, Int, List, TraitError, Unicode, observe, validate
from traitlets.config import Configurable

from . import advice
from .confine.limits import DEFAULT_MEMORY_LIMIT, parse_size
from .confine.paths import GrantError, check_grants
from .confine.privileges import DEFAULT_UID_RANGE
from .confine.scratch import AUTO_SIZE, DEFAULT_SCRATCH_FILES, DEFAULT_SCRATCH_SIZE


class ByteSize(Int):  # type: ignore[type-arg]
    """An integer number of bytes that also accepts 512M / 2G on the command line."""

    def from_string(self, s: str) -> int:
        """Bytes from a command-line value such as 512M or 2G (-1 where the default is -1)."""
        if s.strip() == "-1" and self.default_value == -1:  # "choose for me", where it may
            return -1
        try:
            return parse_size(s)
        except ValueError as exc:
            raise TraitError(str(exc)) from None


class SandboxPolicy(Configurable):
    """What untrusted code in one kernel may do."""

    network = Enum(
        ["off", "hosts", "on"], "off",
        help="User code's network, always in a namespace of the kernel's own and only through "
        "the egress proxy outside the sandbox: 'off' (no sockets at all), 'hosts' (only the "
        "names of --allow-host), 'on' (any public address). Loopback, private, link-local and "
        "metadata addresses are refused whatever the setting, unless --allow-address grants "
        "one.",
    ).tag(config=True, flag="network", metavar="off|hosts|on")

    allow_network = Bool(
        False, help="The same as --network on (kept for existing kernelspecs and callers).",
    ).tag(config=True, flag="allow-network")

    allow_hosts = List(
        Unicode(), help="With --network hosts: a name user code may reach through the proxy "
        "(repeatable): api.example.com, *.example.com (any name below it), optionally :PORT; "
        "or an address or CIDR (203.0.113.0/24) for the few who need them.",
    ).tag(config=True, flag="allow-host", metavar="NAME[:PORT]")

    allow_addresses = List(
        Unicode(), help="A loopback, private or link-local address (or CIDR), optionally "
        ":PORT, the egress proxy may connect to after all (repeatable): only for a service "
        "meant for user code, e.g. 10.0.0.5:5432.",
    ).tag(config=True, flag="allow-address", metavar="CIDR[:PORT]")

    upstream_proxy = Unicode(
        "", help="Send all egress through this HTTP proxy (http://[user:pass@]HOST:PORT), e.g. "
        "Dify's SSRF proxy or a corporate proxy. The egress proxy still applies the policy.",
    ).tag(config=True, flag="upstream-proxy", metavar="URL")

    upstream_ca = Unicode(
        "", help="A PEM file of CA certificates the egress proxy trusts, beside the system "
        "store, for the hosts it adds a secret for (it verifies them itself, having ended the "
        "kernel's TLS): a private CA's. Read by the kernel's companion, outside the sandbox.",
    ).tag(config=True, flag="upstream-ca", metavar="FILE")

    package_index = Unicode(
        "", help="The package index (its simple-API URL) that pip installs from inside a "
        "kernel (the pip magic); empty: pip's default index. The network policy must let the "
        "kernel reach it. A token goes in as a secret's name, never its value: "
        "'https://${TOKEN}@index.example/simple' with --secret TOKEN=index.example.",
    ).tag(config=True, flag="package-index", metavar="URL")

    secrets = List(
        Unicode(), help="A credential user code may use but never read: NAME=HOST "
        "(repeatable; repeat the name for more hosts, in --allow-host's syntax). User code's "
        "os.environ[NAME] holds a placeholder; the egress proxy, outside the sandbox, puts the "
        "value in place of it in requests to HOST. The value is the launcher's environment "
        "variable NAME (or NAME's entry in --secrets-file), never a command-line argument. "
        "HOST must be reachable under --network.",
    ).tag(config=True, flag="secret", metavar="NAME=HOST")

    secrets_file = Unicode(
        "", help='A JSON file of secrets, {"NAME": {"value": "...", "hosts": ["HOST", ...]}}, '
        "read by the launcher at each kernel start (never by the kernel); it must be readable "
        "by its owner only (chmod 600).",
    ).tag(config=True, flag="secrets-file", metavar="FILE")

    read_paths = List(
        Unicode(), help="Extra paths user code may read (repeatable). Each must exist.",
    ).tag(config=True, flag="read-path", metavar="PATH")

    write_paths = List(
        Unicode(), help="Extra paths user code may read and write (repeatable). Each must exist.",
    ).tag(config=True, flag="write-path", metavar="PATH")

    grant_cwd = Enum(
        ["", "ro", "rw"], "",
        help="Grant user code the folder the kernel starts in (under Jupyter, the notebook's "
        "folder) and make it the working directory, so that relative paths such as "
        "'sales.csv' resolve there: 'ro' read-only, 'rw' read-write, '' not granted (the "
        "working directory is then the scratch). HOME and the temporary directory stay the "
        "scratch either way. A folder holding Jupyter's runtime directory, the audit log, "
        "or / is never granted.",
    ).tag(config=True, flag="grant-cwd", metavar="ro|rw", flag_const="ro",
          flag_help="Grant user code the folder the kernel starts in (the notebook's folder "
          "under Jupyter) as its working directory, so relative paths resolve there: "
          "read-only, or read-write with `--grant-cwd rw`. HOME and temp stay the scratch.")

    env = Dict(
        value_trait=Unicode(), key_trait=Unicode(),
        help="Environment variables to set for user code (repeatable NAME=VALUE), applied once "
        "it is confined. Names the dynamic loader or the interpreter act on (LD_*, PYTHON*, "
        "GCONV_PATH, MALLOC_*, ...) are refused unless --allow-loader-env.",
    ).tag(config=True, flag="env", metavar="NAME=VALUE")

    pass_env = List(
        Unicode(), help="Variables to pass through from the launching environment (repeatable). "
        "Names the dynamic loader or the interpreter act on are refused unless "
        "--allow-loader-env.",
    ).tag(config=True, flag="pass-env", metavar="NAME")

    allow_loader_env = Bool(
        False, help="Accept --env and --pass-env names the dynamic loader, libc or the "
        "interpreter act on (LD_PRELOAD, PYTHONPATH, GCONV_PATH, ...). --env values still "
        "apply only once user code is confined.",
    ).tag(config=True, flag="allow-loader-env")

    memory_limit = ByteSize(
        DEFAULT_MEMORY_LIMIT,
        help="Most memory the kernel may hold, its scratch tmpfs included: the scratch takes "
        "--scratch-size out of it and the heap (RLIMIT_DATA, plus no shared anonymous memory) "
        "gets the rest; 0 for no limit. Accepts 512M, 2G.",
    ).tag(config=True, flag="memory-limit", metavar="SIZE")

    cpu_limit = Int(
        0, help="CPU seconds the kernel may use over its whole life (RLIMIT_CPU); 0 for none.",
    ).tag(config=True, flag="cpu-limit", metavar="SECONDS")

    file_size_limit = ByteSize(
        2**30, help="Largest file user code may write (RLIMIT_FSIZE); 0 for no limit.",
    ).tag(config=True, flag="file-size-limit", metavar="SIZE")

    scratch_size = ByteSize(
        AUTO_SIZE,
        help="Most bytes all files in the scratch directory may hold, as a private tmpfs "
        "(needs root; elsewhere only --file-size-limit bounds each file), taken out of "
        f"--memory-limit. -1 (default): a quarter of the memory limit, at most "
        f"{DEFAULT_SCRATCH_SIZE // 2**30} GiB. 0: no tmpfs.",
    ).tag(config=True, flag="scratch-size", metavar="SIZE")

    scratch_files = Int(
        DEFAULT_SCRATCH_FILES,
        help="Most files and directories the scratch tmpfs may hold (its inodes cost the host "
        "kernel memory outside every limit, ~1 KiB each).",
    ).tag(config=True, flag="scratch-files", metavar="N")

    open_files_limit = Int(
        1024, help="Most file descriptors open at once (RLIMIT_NOFILE).",
    ).tag(config=True, flag="open-files-limit", metavar="N")

    max_threads = Int(
        512, help="Most threads user code may run at once; past it, starting a thread raises "
        "RuntimeError. Kept by RLIMIT_NPROC of the uid user code runs as; uid 0 is exempt from "
        "it, so a kernel whose code would run as uid 0 refuses to start unless this is 0 "
        "(no bound).",
    ).tag(config=True, flag="max-threads", metavar="N")

    nice = Int(
        5, min=0, max=19,
        help="How much lower than its launcher's the kernel's CPU priority is, as nice(1) adds "
        "(0-19): under load its launcher (a service's event loop and health checks, a "
        "notebook server) keeps the CPU it needs. User code cannot take it back (RLIMIT_NICE "
        "and RLIMIT_RTPRIO 0). 0: the launcher's priority.",
    ).tag(config=True, flag="nice", metavar="N")

    landlock_abi = Int(
        -1, help="Act as if the host's Landlock ABI were at most N (0: as if it had none), to "
        "see how the sandbox behaves on older hosts; never more than the host offers. "
        "-1: the host's.",
    ).tag(config=True, flag="landlock-abi", metavar="N")

    timeout = Float(
        0.0, help="Default seconds one execution may run before it is interrupted; 0 for none. "
        "A request's metadata.sandbox.timeout overrides it.",
    ).tag(config=True, flag="timeout", metavar="SECONDS")

    max_output_bytes = ByteSize(
        2**20, help="Stream output kept per execution; beyond it output is dropped and one "
        "marker says how much. 0 for no cap.",
    ).tag(config=True, flag="max-output", metavar="SIZE")

    max_result_bytes = ByteSize(
        16 * 2**20, help="Largest main() result, in bytes of JSON; past it the call fails with "
        "InvalidResult (the kernel) or ResultTooLarge (the client, whatever the kernel sends). "
        "0 for no limit.",
    ).tag(config=True, flag="max-result", metavar="SIZE")

    run_as = Unicode(
        "auto", help="When started as root, whom user code runs as: 'auto' (a uid of the "
        "kernel's own from --uid-range), a user name or UID[:GID] (shared by every kernel "
        "started so), or 'root' (uid 0 with every capability dropped: only on purpose).",
    ).tag(config=True, flag="run-as", metavar="USER")

    uid_range = Unicode(
        DEFAULT_UID_RANGE, help="When started as root with --run-as auto, the uids (each "
        "also the gid) kernels take one each of: FIRST-LAST. Ids of accounts, groups and "
        "/etc/subuid ranges are skipped.",
    ).tag(config=True, flag="uid-range", metavar="FIRST-LAST")

    uid_lock_dir = Unicode(
        "", help="When started as root with --run-as auto, the root-only directory of the "
        "locks that keep each uid to one kernel; every kernel of the host must use the same. "
        "Default: /run/sandbox-kernel/uids, or /tmp/sandbox-kernel-uids where /run is "
        "read-only.",
    ).tag(config=True, flag="uid-lock-dir", metavar="DIR")

    audit_log = Unicode(
        "", help="Append the audit record to this file: one JSON line per system call the "
        "filter refused (kernel id, call, arguments) and per egress connection (at its open "
        "and its end), written by the kernel's unconfined companion; user code cannot reach "
        "it. Without it the record goes to /var/log/sandbox-kernel/audit.jsonl (as root) or "
        "~/.local/state/sandbox-kernel/audit.jsonl (`sandbox-kernel check` names it); none of "
        "it goes to the launcher's terminal.",
    ).tag(config=True, flag="audit-log", metavar="PATH")

    changed_with = Unicode(
        "", help="How whoever started the kernel changes this policy, for the step a refusal's "
        "explanation ends with (advice.py): the command its flags go after ('sandbox-kernel "
        "install --sys-prefix', 'sandbox-kernel run'), or 'SandboxPolicy' for a caller of the "
        "Python client. Set by each launcher; empty: `sandbox-kernel install`. Confines "
        "nothing.",
    ).tag(config=True)

    require_landlock = Bool(
        True,
        help="Refuse to start when Landlock cannot be applied. Turning this off runs untrusted "
        "code with no file-system confinement: only for hosts without Landlock.",
    ).tag(config=True, flag="no-landlock", flag_value=False,
          flag_help="Start even without Landlock: untrusted code then has NO file-system "
          "confinement (it may read and write whatever the kernel's user can). Only for hosts "
          "without Landlock.")

    require_seccomp = Bool(
        True,
        help="Refuse to start when the seccomp filter cannot be loaded. Turning this off runs "
        "untrusted code without a system-call filter: only for hosts that cannot load one.",
    ).tag(config=True, flag="no-seccomp", flag_value=False,
          flag_help="Start even without the seccomp filter: untrusted code may then create "
          "processes, open sockets and make any system call. Only for hosts that cannot load "
          "a filter.")

    @observe("allow_network")
    def _allow_network_is_network_on(self, change: dict[str, Any]) -> None:
        if change["new"] and self.network == "off":
            self.network = "on"
        elif not change["new"]:
            self.network = "off"

    @observe("network")
    def _network_allows_sockets(self, change: dict[str, Any]) -> None:
        self.allow_network = change["new"] != "off"

    @validate("allow_hosts")
    def _valid_hosts(self, proposal: dict[str, Any]) -> list[str]:
        return _checked(proposal["value"], "parse_host_entry", "--allow-host")

    @validate("allow_addresses")
    def _valid_addresses(self, proposal: dict[str, Any]) -> list[str]:
        return _checked(proposal["value"], "parse_net", "--allow-address")

    @validate("secrets")
    def _valid_secrets(self, proposal: dict[str, Any]) -> list[str]:
        if proposal["value"]:
            from .secrets import SecretError, declared

            try:
                declared(proposal["value"])
            except SecretError as exc:
                raise TraitError(str(exc)) from None
        return list(proposal["value"])

    def holds_credentials(self) -> bool:
        """Whether kernels of this policy need a vault: secrets, or upstream credentials."""
        from .secrets import without_credentials

        return bool(self.secrets or self.secrets_file
                    or without_credentials(self.upstream_proxy) != self.upstream_proxy)

    def declared_secrets(self) -> dict[str, list[str]]:
        """The secrets this policy declares, {NAME: [HOST, ...]}, the secrets file's included.

        Raises secrets.SecretError when one cannot be used: a bad or world-readable file, or a
        host the network policy does not reach (naming both).
        """
        from .secrets import check_reachable, declared, read_file

        hosts = declared(self.secrets)
        if self.secrets_file:
            for name, entry in read_file(self.secrets_file).items():
                hosts.setdefault(name, []).extend(entry["hosts"])
        check_reachable(hosts, self.network, self.allow_hosts, self.allow_addresses)
        return hosts

    @validate("package_index")
    def _index_without_credentials(self, proposal: dict[str, Any]) -> str:
        from .secrets import SecretError, check_index

        try:
            check_index(proposal["value"])
        except SecretError as exc:
            raise TraitError(str(exc)) from None
        return str(proposal["value"])

    @validate("upstream_proxy")
    def _valid_upstream(self, proposal: dict[str, Any]) -> str:
        if proposal["value"]:
            from .confine.egress.rules import Upstream  # ipaddress: only when it is set

            try:
                Upstream.parse(proposal["value"])
            except ValueError as exc:
                raise TraitError(f"--upstream-proxy: {exc}") from None
        return str(proposal["value"])

    def as_dict(self) -> dict[str, Any]:
        """The effective policy as plain JSON-able values (the upstream proxy's credentials
        left out: they go by the vault, secrets.py)."""
        values = {name: getattr(self, name) for name in self.trait_names(config=True)}
        if values["upstream_proxy"]:
            from .secrets import remember_upstream

            values["upstream_proxy"] = remember_upstream(values["upstream_proxy"])
        return values

    def _implied(self, name: str) -> bool:
        """allow_network and network say one thing twice: `on` is said by allow_network (what
        older kernelspecs carry), `hosts` by network."""
        if name == "network":
            return self.network == "on"
        return name == "allow_network" and self.network == "hosts"

    def to_argv(self) -> list[str]:
        """Command-line options that recreate this policy in a kernel process."""
        argv = []
        for name, trait in sorted(self.traits(config=True).items()):
            value = getattr(self, name)
            if value == trait.default() or self._implied(name):
                continue
            if name == "upstream_proxy":  # its credentials go by the vault (secrets.py)
                from .secrets import remember_upstream

                value = remember_upstream(value)
            if isinstance(value, dict):
                argv += [f"--SandboxPolicy.{name}={key}={item}" for key, item in value.items()]
            elif isinstance(value, list):
                argv += [f"--SandboxPolicy.{name}={item}" for item in value]
            else:
                argv.append(f"--SandboxPolicy.{name}={value}")
        return argv


advice.register(SandboxPolicy)  # advice words a Python caller's change with its flags


def from_kernel_argv(argv: list[str]) -> SandboxPolicy:
    """The policy a kernel's argv (`--SandboxPolicy.x=...` and the policy flags) gives it.

    For the launcher, which must know the secrets a kernel it starts declares; options that
    are not the policy's are ignored.
    """
    from traitlets.config.loader import KVArgParseConfigLoader

    ours = [arg for arg in argv if arg.startswith("--")]
    config = KVArgParseConfigLoader(ours, aliases=app_aliases(),
                                    flags=app_flags()).load_config()  # type: ignore[arg-type]
    return SandboxPolicy(config=config)


def _checked(entries: list[str], parser: str, flag: str) -> list[str]:
    """entries, each checked by the egress rules' parser (imported only when there are any)."""
    if not entries:
        return entries
    from .confine.egress import rules

    for entry in entries:
        try:
            getattr(rules, parser)(entry)
        except rules.RuleError as exc:
            raise TraitError(f"{flag}: {exc}") from None
    return entries


def _flagged() -> list[tuple[str, Any]]:
    return [(name, trait) for name, trait in SandboxPolicy.class_traits(config=True).items()
            if trait.metadata.get("flag")]


def _flag_help(trait: Any) -> str:
    """What the flag does; differs from the trait's help when the flag turns the trait off."""
    return str(trait.metadata.get("flag_help", trait.help))


def app_flags() -> dict[str, tuple[dict[str, Any], str]]:
    """traitlets flags (`--allow-network`, `--no-seccomp`) for the kernel application."""
    return {trait.metadata["flag"]: ({"SandboxPolicy": {name: trait.metadata.get(
                "flag_value", True)}}, _flag_help(trait))
            for name, trait in _flagged() if isinstance(trait, Bool)}


def app_aliases() -> dict[str, str]:
    """traitlets aliases (`--read-path P`, `--timeout S`, ...) for the kernel application."""
    return {trait.metadata["flag"]: f"SandboxPolicy.{name}"
            for name, trait in _flagged() if not isinstance(trait, Bool)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the policy flags to an argparse parser (install, run and check share them)."""
    group = parser.add_argument_group("sandbox policy")
    for name, trait in _flagged():
        option, help_text = f"--{trait.metadata['flag']}", _flag_help(trait)
        if isinstance(trait, Bool):
            action = "store_false" if trait.metadata.get("flag_value") is False else "store_true"
            group.add_argument(option, dest=name, action=action, default=None, help=help_text)
        else:
            repeatable = isinstance(trait, (List, Dict))
            # A flag with a `flag_const` may be given bare: `--grant-cwd` means `--grant-cwd ro`.
            optional: dict[str, Any] = {"nargs": "?", "const": trait.metadata["flag_const"]} \
                if "flag_const" in trait.metadata else {}
            if isinstance(trait, Enum):
                optional["choices"] = [value for value in trait.values or () if value]
            group.add_argument(option, dest=name, action="append" if repeatable else "store",
                               default=None, metavar=trait.metadata.get("metavar"),
                               help=help_text, **optional)


def spell_bare_flags(argv: list[str]) -> list[str]:
    """argv with each bare flag that has a `flag_const` spelled out (`--grant-cwd=ro`) unless
    a value of its own follows it.

    argparse lets an optional value take whatever word comes next, so `run --grant-cwd job.py`
    read job.py as the flag's value and refused it, where the user meant a bare flag and a file.
    """
    choices = {f"--{trait.metadata['flag']}": (trait.metadata["flag_const"],
                                               {str(v) for v in trait.values or () if v})
               for _, trait in _flagged() if "flag_const" in trait.metadata}
    spelled: list[str] = []
    for index, word in enumerate(argv):
        if word == "--":
            return spelled + argv[index:]
        if word in choices:
            const, values = choices[word]
            following = argv[index + 1] if index + 1 < len(argv) else None
            if following not in values:
                word = f"{word}={const}"
        spelled.append(word)
    return spelled


def from_arguments(args: argparse.Namespace) -> SandboxPolicy:
    """A validated policy from argparse flags, grants made absolute.

    Raises TraitError for a bad value or a grant that is or passes through a symbolic link,
    and FileNotFoundError for a grant that does not exist.
    """
    values: dict[str, Any] = {}
    for name, trait in _flagged():
        given = getattr(args, name, None)
        if given is None:
            continue
        if isinstance(trait, Dict):
            values[name] = dict(_name_value(item) for item in given)
        elif name in ("read_paths", "write_paths"):
            values[name] = _checked_grants(given, f"--{trait.metadata['flag']}")
        elif isinstance(trait, (List, Bool)):
            values[name] = given
        else:
            values[name] = trait.from_string(given)
    return SandboxPolicy(**values)


def _checked_grants(given: list[str], flag: str) -> list[str]:
    try:
        return check_grants(given, flag)
    except GrantError as exc:
        raise TraitError(str(exc)) from None


def _name_value(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise TraitError(f"expected NAME=VALUE, got {item!r}")
    return name, value
