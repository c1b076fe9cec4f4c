"""The one error every confinement layer raises: which layer failed, why, and the fix.

Modelled on the `landlock` package (`SyscallError(OSError, LandlockError)` with a `reason`):
each layer subclasses ConfinementError, naming itself and the flag that waives it, so that the
kernel catches one type and its refusal prints what is missing and how to start without it,
while a layer whose failure is also an OS error (Landlock's, with its errno) stays an OSError.
"""

from __future__ import annotations


class ConfinementError(Exception):
    """A layer could not be put in place: the kernel must not run user code."""

    layer = "confinement"  # the layer's name, the first word of the refusal
    fix = ""  # how to start on purpose without the layer; "" when the reason says the fix

    def __init__(self, *args: object, layer: str | None = None, fix: str | None = None) -> None:
        super().__init__(*args)
        if layer is not None:
            self.layer = layer
        if fix is not None:
            self.fix = fix

    @property
    def reason(self) -> str:
        """What went wrong, as the layer said it."""
        return str(self)

    def refusal(self) -> str:
        """The line a kernel that refuses to start prints: layer, reason and the fix."""
        if not self.fix:  # the reason already names its cure (e.g. "say --run-as root")
            return self.reason
        return f"{self.layer}: {self.reason}. {self.fix}"


def waiver(what: str, flag: str) -> str:
    """The fix of a layer that a flag switches off: how to start without what it keeps."""
    return f"To run without {what} on purpose, start the kernel with {flag}"
