"""Writing the kernelspec that Jupyter uses to start the sandboxed kernel."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_core.paths import SYSTEM_JUPYTER_PATH, jupyter_data_dir, jupyter_path

from .launch import eg_kernelspec
from .launch.provisioner import NAME as PROVISIONER
from .policy import SandboxPolicy

DEFAULT_NAME = "sandbox"
DEFAULT_DISPLAY_NAME = "Python 3 (sandbox)"
NAMED_DISPLAY_NAME = "Python 3 (sandbox: {name})"  # as runtimes/ names its kernelspecs


class InstallError(Exception):
    """The kernelspec could not be written; the message says why and what to do."""


def template_dir() -> Path:
    """The kernelspec template: inside the wheel, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernelspec", here.parent / "kernelspec"):
        if (candidate / "kernel.json").is_file():
            return candidate
    raise InstallError(f"the kernelspec template is missing next to {here}; reinstall the package")


def provisioner(cold_start: bool = False, preload: Sequence[str] = ()) -> dict:
    """The kernelspec's `metadata.kernel_provisioner`: fork-served unless cold_start."""
    return {"provisioner_name": PROVISIONER,
            "config": {"cold_start": cold_start, "preload": sorted(set(preload))}}


def kernel_json(policy: SandboxPolicy, display_name: str, cold_start: bool = False,
                preload: Sequence[str] = (), python: str | None = None,
                runtime: str | None = None) -> dict:
    """kernel.json for this interpreter (or python, a runtime's), with the policy both in argv
    and in the metadata."""
    spec = json.loads((template_dir() / "kernel.json").read_text())
    python = python or sys.executable
    argv = [python if arg == "{python}" else arg for arg in spec["argv"]]
    spec["argv"] = argv + policy.to_argv()
    spec["display_name"] = display_name
    spec["metadata"]["sandbox_kernel"]["policy"] = policy.as_dict()
    spec["metadata"]["kernel_provisioner"] = provisioner(cold_start, preload)
    if runtime:
        spec["metadata"]["sandbox_kernel"]["runtime"] = runtime
    return spec


def default_display_name(name: str) -> str:
    """What the launcher shows for kernelspec `name` unless --display-name says otherwise: two
    kernelspecs installed under different names must not look the same there."""
    return DEFAULT_DISPLAY_NAME if name == DEFAULT_NAME else NAMED_DISPLAY_NAME.format(name=name)


def install(policy: SandboxPolicy, name: str = DEFAULT_NAME,
            display_name: str | None = None, user: bool = False,
            prefix: str | None = None, enterprise_gateway: str | None = None,
            eg_spec: eg_kernelspec.EnterpriseGatewaySpec | None = None,
            cold_start: bool = False, preload: Sequence[str] = (), python: str | None = None,
            runtime: str | None = None) -> str:
    """Install the kernelspec `name`(replacing one of that name); return its directory.

    display_name: what the launcher shows (default: from the name, default_display_name).
    python and runtime: the interpreter of a runtime (runtimes/) and its name.

    With enterprise_gateway (kubernetes, docker, distributed) the kernelspec is one for
    Jupyter Enterprise Gateway's process proxy of that name (see launch/eg_kernelspec.py).
    """
    eg_spec = eg_spec or eg_kernelspec.EnterpriseGatewaySpec()
    display_name = display_name or default_display_name(name)
    if enterprise_gateway:
        try:
            eg_kernelspec.check(enterprise_gateway, eg_spec)
        except ValueError as exc:
            raise InstallError(str(exc)) from exc
    spec = kernel_json(policy, display_name, cold_start, preload, python, runtime)
    path = _install_files(spec, name, user, prefix)
    if enterprise_gateway:
        eg_kernelspec.write(Path(path), enterprise_gateway, policy, display_name, eg_spec, path)
    return path


def _install_files(spec: dict, name: str, user: bool, prefix: str | None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for logo in template_dir().glob("logo-*"):
            shutil.copy(logo, tmp)
        Path(tmp, "kernel.json").write_text(json.dumps(spec, indent=2))
        try:
            return KernelSpecManager().install_kernel_spec(
                tmp, kernel_name=name, user=user, prefix=prefix)
        except ValueError as exc:  # jupyter_client's check of the name
            raise InstallError(f"invalid kernel name {name!r}: {exc}") from exc
        except OSError as exc:
            where = prefix or ("the user's Jupyter data dir" if user else "the system Jupyter dir")
            raise InstallError(
                f"cannot write the kernelspec to {where}: {exc.strerror or exc}; choose --user, "
                "--sys-prefix or a writable --prefix") from exc


def installed_message(path: str, name: str, user: bool = False, prefix: str | None = None,
                      sys_prefix: bool = False, display_name: str | None = None) -> str:
    """What `install` tells the user: where the kernelspec went, how it shows, who sees it, how
    to undo it."""
    flags = "--user " if user else "--sys-prefix " if sys_prefix else \
        f"--prefix {prefix} " if prefix else ""
    undo = f"sandbox-kernel uninstall {flags}--name {name}"
    shown = display_name or default_display_name(name)
    lines = [f"Installed kernelspec {name} in {path}",
             f'  shown as "{shown}" in the launcher (--display-name TEXT to change it)']
    if not (user or prefix or sys_prefix):
        lines.append(
            "  system-wide: every user of this machine, and Jupyter in every Python environment, "
            f"now lists it; it starts {sys.executable}. For yourself only, install with --user "
            "(or --sys-prefix for this environment only).")
    lines.append(f"  to remove it: {undo}")
    return "\n".join(lines)


def kernelspec_dir(name: str, user: bool = False, prefix: str | None = None) -> Path:
    """Where install() writes kernelspec `name` for these options (as jupyter_client does)."""
    if user:
        base = Path(jupyter_data_dir())
    elif prefix:
        base = Path(prefix).absolute() / "share" / "jupyter"
    else:
        base = Path(SYSTEM_JUPYTER_PATH[0])
    return base / "kernels" / name


def shadowing(path: str, name: str) -> list[str]:
    """Warnings for the kernelspec just written to path: Jupyter starts the first kernelspec
    of a name along its search path, so one before it makes the new one change nothing, and
    the new one makes those after it change nothing (a `--user` install over a
    `--sys-prefix` set-up: a refusal's advice must reinstall the one Jupyter starts)."""
    written = Path(path).resolve()
    found = [Path(folder, name).resolve() for folder in jupyter_path("kernels")
             if Path(folder, name, "kernel.json").is_file()]
    if written not in found:
        return [f"{written} is not on Jupyter's kernel search path (`jupyter --paths`): "
                "Jupyter does not list it; install with --user or --sys-prefix, or add "
                f"{written.parent.parent} to JUPYTER_PATH"] if not found else \
            [f"Jupyter starts kernelspec {name} from {found[0]}, not this one, which is not on "
             "its kernel search path: remove that one (`jupyter kernelspec remove "
             f"{name}`) or install with its scope"]
    at = found.index(written)
    return [f"Jupyter starts kernelspec {name} from {other}, which comes first in its search "
            f"path: this one changes nothing until that one is removed (`sandbox-kernel "
            f"uninstall` with that one's scope) or replaced by installing with its scope"
            for other in found[:at]] + \
        [f"this kernelspec {name} shadows the one in {other}, later in Jupyter's search path: "
         "Jupyter no longer starts that one" for other in found[at + 1:]]


def _is_ours(spec_dir: Path) -> bool:
    try:
        spec = json.loads((spec_dir / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(spec, dict) and "sandbox_kernel" in spec.get("metadata", {})


def uninstall(name: str = DEFAULT_NAME, user: bool = False, prefix: str | None = None) -> str:
    """Remove the kernelspec `name` that install() wrote with these options; return its dir."""
    spec_dir = kernelspec_dir(name, user, prefix)
    if not spec_dir.is_dir():
        raise InstallError(f"no kernelspec named {name!r} in {spec_dir.parent}; `jupyter "
                           "kernelspec list` shows where each one is (give the same --user, "
                           "--sys-prefix or --prefix as for install)")
    if not _is_ours(spec_dir):
        raise InstallError(f"{spec_dir} was not installed by sandbox-kernel; leaving it alone "
                           f"(`jupyter kernelspec remove {name}` removes any kernelspec)")
    try:
        shutil.rmtree(spec_dir)
    except OSError as exc:
        raise InstallError(f"cannot remove {spec_dir}: {exc.strerror or exc}") from exc
    return str(spec_dir)
