"""A credential the egress proxy adds on the way out: user code holds only its placeholder.

This is the one shape a secret has wherever it is handled outside the kernel: the launcher
declares it (a name, the hosts it belongs to; its value from the launcher's environment or a
secrets file), user code sees `os.environ[name] == placeholder`, and the kernel's unconfined
companion, the only process that ever holds `value`, puts the value in place of the
placeholder in requests to `hosts` and refuses the placeholder anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Secret:
    """One secret: its name, value, hosts and placeholder."""

    name: str  # the environment variable user code reads (it holds the placeholder)
    value: str  # the credential: only ever in the companion's memory
    hosts: tuple[str, ...]  # where it may go, in --allow-host's syntax
    placeholder: str  # unique per session and secret, e.g. sk-sandbox-NAME-<random>

    def __repr__(self) -> str:  # never print the value, whoever logs a Secret
        return f"Secret(name={self.name!r}, hosts={self.hosts!r}, placeholder={self.placeholder!r})"
