"""`%pip install` in a sandboxed kernel: wheels only, into a directory of the session's own.

The kernel cannot start a process, so IPython's `%pip` (which runs `python -m pip` in a shell)
cannot work; this magic replaces it and runs pip's own command in this process instead. pip has
no public in-process API, but its `main(args)` is the console script's body and installs a
wheel without any subprocess; what it changes in the process (logging, the warnings hook, one
environment variable) is put back afterwards. Another installer library would need its own
resolver and index client: pip is in every kernel environment already.

What is installed goes to `<scratch>/session-packages` (on sys.path, first; counted in the
scratch's size; gone with the kernel), never into the runtime, which is read-only to user code.
Source distributions are refused: building one runs its setup code in a new process. The
package index is the operator's (`--package-index`, else pip's default), reached only as the
network policy allows: with the network off the magic fails at once, saying which setting
allows it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.metadata
import logging
import os
import re
import shlex
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from IPython.core.magic import no_var_expand

SESSION_DIR = "session-packages"
SOURCE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")
SDIST_REFUSED = ("{what} is a source distribution: building it runs its setup code in a new "
                 "process, which the sandbox forbids. %pip installs wheels (.whl) only; ask the "
                 "operator to add the package to a runtime (`sandbox-kernel runtime update`), "
                 "where it is built outside the sandbox")
NO_SPACE = ("the packages do not fit in the session's scratch directory ({size}): "
            "remove files from it, or ask the operator for a larger --scratch-size (or a "
            "runtime with the package)")
NO_WHEEL = ("{name} has no wheel for this Python on the index, only a source distribution, "
            "and building it runs its setup code in a new process, which the sandbox forbids. "
            "Ask the operator to add {name} to a runtime (`sandbox-kernel runtime update`), "
            "where it is built outside the sandbox")


class PackageInstallError(Exception):
    """%pip could not install; the message says why and what allows it."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of frames
        return [f"{type(self).__name__}: {self}"]


def session_dir(scratch: str) -> Path:
    """Where this session's packages go."""
    return Path(scratch) / SESSION_DIR


def _default_index() -> list[str]:
    """pip's own index and the host its files come from, as pip names them."""
    from pip._internal.models.index import PyPI  # type: ignore[import-not-found]

    return [PyPI.simple_url, f"https://{PyPI.file_storage_domain}/"]


def index_refusal(policy: Any) -> str | None:
    """Why the network policy keeps this kernel from the package index, or None if it may.

    Asked of the same rules the egress proxy applies (confine/egress/rules.py), before pip
    starts: the index's host (and, for pip's default index, its file host) must be allowed,
    by name with --network hosts, or by --network on.
    """
    from ..confine.egress.rules import EgressRules, RuleError, parse_address

    index = policy.package_index
    if policy.network == "off":
        return (f"the network is off in this sandbox (--network off), so %pip cannot reach "
                f"{index or 'the package index'}. The operator allows it with --network hosts "
                "--allow-host INDEX-HOST (and the host its files come from), or --network on")
    try:
        # The proxy also refuses the host's own addresses; only it can see them (its namespace).
        rules = EgressRules.parse(policy.network, policy.allow_hosts, policy.allow_addresses,
                                  is_own=lambda address: False)
    except RuleError as exc:
        return f"the kernel's network policy cannot be read: {exc}"
    for url in [index] if index else _default_index():
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        refusal = rules.check_name(host, port)
        address = parse_address(host)
        if refusal is None and address is not None:
            refusal = rules.check_address(host, address, port)
        if refusal is not None:
            return f"%pip cannot reach the package index {url}: {refusal}"
    return None


NOTHING_LISTED = ("Nothing installed in this session yet: %pip list shows what %pip install "
                  "added here, not the packages the kernel's environment comes with.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%pip", add_help=False, exit_on_error=False)
    commands = parser.add_subparsers(dest="command", required=True)
    install = commands.add_parser("install", add_help=False, exit_on_error=False)
    install.add_argument("requirements", nargs="*")
    install.add_argument("-r", "--requirement", action="append", default=[], dest="files")
    install.add_argument("-U", "--upgrade", action="store_true")
    install.add_argument("--force-reinstall", action="store_true")
    install.add_argument("--no-deps", action="store_true")
    install.add_argument("--pre", action="store_true")
    install.add_argument("-q", "--quiet", action="count", default=0)
    install.add_argument("-v", "--verbose", action="count", default=0)
    commands.add_parser("list", add_help=False, exit_on_error=False)
    return parser


USAGE = ("usage: %pip install [-U] [--no-deps] [--pre] [--force-reinstall] [-q] [-r FILE] "
         "PACKAGE...  |  %pip list   (wheels only, into this session)")


def parse(line: str) -> argparse.Namespace:
    """The magic's arguments, or PackageInstallError naming what is not available."""
    try:
        words = shlex.split(line)
        args, unknown = _parser().parse_known_args(words)
    except (argparse.ArgumentError, ValueError, SystemExit) as exc:
        raise PackageInstallError(f"{exc or 'no command given'}; {USAGE}") from None
    if unknown:
        raise PackageInstallError(f"{' '.join(unknown)}: not available in the sandbox "
                                  f"(the index, target and build are set by the sandbox); "
                                  f"{USAGE}")
    if args.command == "install" and not (args.requirements or args.files):
        raise PackageInstallError(f"name the packages to install; {USAGE}")
    return args


def _looks_like_source(requirement: str) -> bool:
    """A requirement that names a source archive, a directory or a VCS checkout."""
    lowered = requirement.lower().split("#", 1)[0]
    if lowered.endswith(".whl"):
        return False
    vcs = "://" in lowered and "+" in lowered.split("://", 1)[0]  # git+https://...
    return lowered.endswith(SOURCE_SUFFIXES) or vcs or lowered.startswith((".", "/", "~"))


def check_wheels_only(requirements: list[str]) -> None:
    """Refuse, before any download, requirements that can only be built from source."""
    for requirement in requirements:
        if _looks_like_source(requirement):
            raise PackageInstallError(SDIST_REFUSED.format(what=requirement))


def check_requirement_files(paths: list[str]) -> None:
    """Hold -r files to the magic's own rules: requirements only, no options, no sources."""
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise PackageInstallError(f"cannot read the requirements file {path}: "
                                      f"{exc.strerror or exc}") from None
        for line in lines:
            requirement = line.split(" #", 1)[0].strip()
            if requirement.startswith("-"):
                raise PackageInstallError(
                    f"{path}: {requirement}: options in requirements files are not available "
                    "in the sandbox (the index, target and build are set by the sandbox)")
            if requirement and not requirement.startswith("#"):
                check_wheels_only([requirement])


def pip_arguments(args: argparse.Namespace, target: Path, index: str) -> list[str]:
    """pip's command line: the user's choices inside the sandbox's fixed ones."""
    command = ["install", "--target", str(target), "--only-binary", ":all:", "--isolated",
               "--no-cache-dir", "--disable-pip-version-check", "--no-input",
               "--progress-bar", "off", "--no-warn-script-location",
               # pip's conflict check reads every distribution on sys.path, parts of which the
               # sandbox hides (an editable install's checkout): it failed with a red "Error
               # while checking for conflicts" on installs that worked. A --target install
               # changes nothing of the environment it would check.
               "--no-warn-conflicts"]
    if index:  # ${TOKEN}: a secret's placeholder, which the egress proxy replaces (secrets.py)
        command += ["--index-url", os.path.expandvars(index)]
    for flag in ("upgrade", "force_reinstall", "no_deps", "pre"):
        if getattr(args, flag):
            command.append("--" + flag.replace("_", "-"))
    command += ["-q"] * args.quiet + ["-v"] * args.verbose
    for path in args.files:
        command += ["-r", path]
    return command + args.requirements


class _PipLog(logging.Handler):
    """Keeps pip's error records, to name the cause of a failure."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:  # pip's "Exception:" record
            self.errors.append(f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}")


def _modes_ignored_under(directory: str, chmod: Any) -> Any:
    """os.chmod that skips files under directory when the sandbox refuses it (it always does).

    pip sets the mode of each file it writes (0644 for RECORD and friends, +x for scripts);
    the filter refuses chmod, and in a directory only this kernel's uid can enter, the mode
    tempfile gave the file (0600) serves as well.
    """
    prefix = directory.rstrip("/") + "/"

    def tolerant_chmod(path: Any, mode: int, *args: Any, **kwargs: Any) -> None:
        try:
            chmod(path, mode, *args, **kwargs)
        except PermissionError:
            if not os.path.abspath(os.fsdecode(path)).startswith(prefix):
                raise

    return tolerant_chmod


@contextlib.contextmanager
def _pip_in_process(scratch: str) -> Iterator[_PipLog]:
    """Let pip run here and put back what it changes in the process."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, warnings.showwarning, warnings.filters[:],
             os.environ.get("PIP_CONFIG_FILE"))
    recorder = _PipLog()
    pip_logger = logging.getLogger("pip")
    pip_logger.addHandler(recorder)
    # pip's User-Agent asks `distro`, which runs lsb_release (a process) and reads /etc files
    # the sandbox does not grant: both refused, the second fatal. The header is informational.
    from pip import __version__ as pip_version
    from pip._internal.network import session  # type: ignore[import-not-found]

    saved_agent = session.user_agent
    session.user_agent = lambda: f"pip/{pip_version} (sandbox-kernel)"
    # pip's console (rich) sees the kernel's shell and sends each line as an HTML display;
    # stock ipykernel's %pip runs pip on a pipe: plain text on stdout, which pip writes here too.
    from pip._vendor.rich import console  # type: ignore[import-not-found]

    saved_jupyter = getattr(console, "_is_jupyter", None)  # a pip whose rich lacks it: as is
    if saved_jupyter is not None:
        console._is_jupyter = lambda: False
    # No configuration file: the host's (index, find-links) is not the sandbox's to use.
    os.environ["PIP_CONFIG_FILE"] = os.devnull
    chmod, os.chmod = os.chmod, _modes_ignored_under(scratch, os.chmod)
    try:
        yield recorder
    finally:
        os.chmod = chmod
        session.user_agent = saved_agent
        if saved_jupyter is not None:
            console._is_jupyter = saved_jupyter
        pip_logger.removeHandler(recorder)
        root.handlers[:], root.level = saved[0], saved[1]
        # a list at run time; typeshed calls it a Sequence
        warnings.showwarning, warnings.filters[:] = saved[2], saved[3]  # type: ignore[index]
        if saved[4] is None:
            os.environ.pop("PIP_CONFIG_FILE", None)
        else:
            os.environ["PIP_CONFIG_FILE"] = saved[4]


def _installed(directory: Path) -> dict[str, str]:
    """name -> version of the distributions in a directory."""
    return {dist.metadata["Name"]: dist.version
            for dist in importlib.metadata.distributions(path=[str(directory)])}


def _scratch_size(scratch: str) -> str:
    stats = os.statvfs(scratch)
    size = stats.f_blocks * stats.f_frsize
    return f"{size / 2**20:.0f} MiB"


def _explain_failure(errors: list[str], scratch: str, requirements: list[str],
                     index: str) -> str:
    text = "\n".join(errors)
    if f"[Errno {errno.ENOSPC}]" in text or f"[Errno {errno.EFBIG}]" in text:
        return NO_SPACE.format(size=_scratch_size(scratch))
    missing = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)", text)
    if missing and _has_source_only(missing.group(1), index, scratch):
        return NO_WHEEL.format(name=missing.group(1))
    last = errors[-1].strip().splitlines()[0] if errors else "pip failed"
    return f"pip could not install {' '.join(requirements)}: {last}"


def _has_source_only(name: str, index: str, scratch: str) -> bool:
    """Whether the index offers name as a source distribution (pip found no wheel for it)."""
    # pip's finder, as `pip index versions` uses it, without that command's look at the
    # installed distributions (sys.path entries the sandbox does not let it list).
    from pip._internal.index.collector import LinkCollector
    from pip._internal.index.package_finder import PackageFinder
    from pip._internal.models.index import PyPI
    from pip._internal.models.search_scope import SearchScope
    from pip._internal.models.selection_prefs import SelectionPreferences
    from pip._internal.network.session import PipSession

    with _pip_in_process(scratch), PipSession() as session:
        scope = SearchScope.create(find_links=[], index_urls=[index or PyPI.simple_url],
                                   no_index=False)
        finder = PackageFinder.create(
            link_collector=LinkCollector(session=session, search_scope=scope),
            selection_prefs=SelectionPreferences(allow_yanked=False,
                                                 allow_all_prereleases=True))
        try:
            candidates = finder.find_all_candidates(name)
        except Exception:  # only a better message was at stake
            return False
    return any(not candidate.link.is_wheel for candidate in candidates)


def install(line: str, policy: Any, scratch: str) -> dict[str, str]:
    """Run `%pip install ...` in this process; the distributions it added or changed."""
    args = parse(line)
    if args.command == "list":
        return _installed(session_dir(scratch))
    check_wheels_only(args.requirements)
    check_requirement_files(args.files)
    refusal = index_refusal(policy)
    if refusal:
        raise PackageInstallError(refusal)
    try:
        from pip._internal.cli.main import main as pip_main
    except ImportError:
        raise PackageInstallError("pip is not installed in this kernel's environment; ask the "
                                  "operator for a runtime with the package") from None
    target = session_dir(scratch)
    target.mkdir(exist_ok=True)
    before = _installed(target)
    with _pip_in_process(scratch) as log:
        status = pip_main(pip_arguments(args, target, policy.package_index))
    if status:
        raise PackageInstallError(_explain_failure(log.errors, scratch, args.requirements,
                                                   policy.package_index))
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    after = _installed(target)
    return {name: version for name, version in after.items() if before.get(name) != version}


@no_var_expand
def pip_magic(line: str) -> None:
    """%pip install PACKAGE...: wheels into this session (gone with the kernel); %pip list."""
    __tracebackhide__ = True
    from IPython import get_ipython

    kernel = get_ipython().kernel  # type: ignore[union-attr]
    scratch = kernel.sandbox_info["layers"]["scratch"]["path"]
    changed = install(line, kernel.policy, scratch)
    if line.split()[:1] == ["list"]:
        for name, version in sorted(changed.items(), key=lambda item: item[0].lower()):
            print(f"{name}=={version}")
        if not changed:
            print(NOTHING_LISTED)
        return
    if changed:
        shown = ", ".join(f"{name}=={version}" for name, version in sorted(changed.items()))
        print(f"Installed into this session: {shown}. Import it in the next cell; it goes "
              "with the kernel.")


def load_ipython_extension(shell: Any) -> None:
    """Register `%pip` in place of IPython's (which needs a subprocess)."""
    shell.register_magic_function(pip_magic, "line", "pip")
