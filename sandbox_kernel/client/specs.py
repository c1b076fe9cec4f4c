"""Which kernelspec a sandbox starts: an installed one, or one built from this package."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from ..install import kernel_json
from ..policy import SandboxPolicy


class PackageSpecs(KernelSpecManager):
    """Serves a kernelspec built from this package, for sandboxes started without installing."""

    def __init__(self, policy: SandboxPolicy, cold_start: bool = False,
                 preload: Sequence[str] = (), python: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = KernelSpec(**kernel_json(policy, "sandbox (package)", cold_start, preload,
                                             python))

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        """The package's kernelspec, whatever the name."""
        return self.spec


_MADE: dict[tuple[Any, ...], PackageSpecs] = {}
_MADE_AT_MOST = 64  # different policies a process keeps specs of (a service has a handful)


def package_specs(policy: SandboxPolicy, cold_start: bool = False, preload: Sequence[str] = (),
                  python: str | None = None) -> PackageSpecs:
    """The PackageSpecs of these settings, made once: the spec is the same for every kernel
    of a policy, and building it (template file, traitlets objects) was a twentieth of what a
    fresh-kernel request cost its caller. Nothing a kernel manager does changes it."""
    key = (tuple(policy.to_argv()), cold_start, tuple(preload), python)
    specs = _MADE.get(key)
    if specs is None:
        if len(_MADE) >= _MADE_AT_MOST:
            _MADE.clear()
        specs = _MADE[key] = PackageSpecs(policy, cold_start, preload, python)
    return specs


def manager_kwargs(kernel_name: str | None, policy: SandboxPolicy | None, cold_start: bool,
                   preload: Sequence[str], python: str | None = None) -> dict[str, Any]:
    """The kernel manager's arguments: an installed kernelspec's name, or the package's spec
    (on python, a runtime's interpreter, when given)."""
    if kernel_name is None:
        return {"kernel_name": "sandbox-package",
                "kernel_spec_manager": package_specs(policy or SandboxPolicy(), cold_start,
                                                     preload, python)}
    if policy is not None or cold_start or preload:
        raise ValueError("give either kernel_name (an installed kernelspec, which sets policy, "
                         "cold start and preload) or those options, not both")
    return {"kernel_name": kernel_name}


def installed_policy(kernel_name: str) -> dict[str, Any]:
    """The policy an installed kernelspec records (caller-side, so user code cannot alter it)."""
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        return {}  # start_kernel will say so
    policy = spec.metadata.get("sandbox_kernel", {}).get("policy", {})
    return policy if isinstance(policy, dict) else {}
