"""The lean one-shot process's shell: IPython's InteractiveShell, its output as Jupyter messages.

ipykernel's ZMQInteractiveShell is InteractiveShell plus what a kernel on ZMQ sockets needs; a
one-shot process (kernel/lean.py) has one connection and one request, and its image must hold
none of ipykernel's kernel, jupyter_client or ZMQ. What the caller sees is kept: each part here
sends, through the process's `Outbox` (messages.py's builder on oneshot_io's Channel), the
message ipykernel's part sends, with the same content:

- `ChannelDisplayPublisher`: display_data / update_display_data, clear_output;
- `ChannelDisplayHook`: a cell's last value as execute_result;
- the shell's `_showtraceback`: the `error` message, and the traceback the reply repeats;
- the pager's text and `exit()` as reply payloads, as a notebook frontend gets them;
- the environment a notebook kernel sets for tools it starts (`NOTEBOOK_ENVIRONMENT`);
- cells compiled by ipykernel's own compiler module (loaded by path, without its package,
  whose __init__ imports jupyter_client): a cell's file name, in tracebacks, warnings and code
  objects, is the one a ZMQ kernel gives it.

The class keeps ipykernel's shell's name: libraries tell a notebook from a terminal by
`type(get_ipython()).__name__` (tqdm, plotly), and a one-shot run's output is a notebook's.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from IPython.core import page
from IPython.core.autocall import ZMQExitAutocall
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell, InteractiveShellABC
from IPython.core.profiledir import ProfileDir
from IPython.paths import get_ipython_dir, get_ipython_package_dir
from IPython.utils.path import get_home_dir
from traitlets import Any as AnyTrait
from traitlets import CBool, Instance, Type, default

from .renew import Renewable

# What ipykernel's shell sets in os.environ for the programs a cell starts (ls colours, no
# pager); a one-shot can start none, but user code reads its environment as a kernel's.
NOTEBOOK_ENVIRONMENT = {"TERM": "xterm-color", "CLICOLOR": "1", "FORCE_COLOR": "1",
                        "CLICOLOR_FORCE": "1", "PAGER": "cat", "GIT_PAGER": "cat"}
COMPILER_MODULE = "sandbox_kernel.kernel._ipykernel_compiler"
# A profile dir's folders, as ProfileDir's observers make them: (its trait, name, mkdir's mode).
PROFILE_FOLDERS = (("security_dir", "security", 0o700), ("log_dir", "log", 0o777),
                   ("startup_dir", "startup", 0o777), ("pid_dir", "pid", 0o700))


def _startup_readme() -> tuple[bytes, int] | None:
    """The README ProfileDir copies into a new startup folder: its bytes and mode, read once
    (in the zygote); None if IPython ships none (ProfileDir then only warns)."""
    source = os.path.join(get_ipython_package_dir(), "core", "profile", "README_STARTUP")
    try:
        with open(source, "rb") as file:
            return file.read(), stat.S_IMODE(os.fstat(file.fileno()).st_mode)
    except OSError:
        return None


STARTUP_README = _startup_readme()


def make_profile_dir(profile: ProfileDir | None) -> tuple[str, ProfileDir]:
    """This process's IPython dir and default profile dir, as `get_ipython_dir()` and
    `ProfileDir.create_profile_dir_by_name(ipython_dir, "default")` make them: the folders,
    their modes and startup's README.

    Where IPYTHONDIR is a folder this call makes (the scratch's, new with the process), the
    profile is made with one mkdir a folder and its README written from the zygote's copy, and
    profile (the zygote's ProfileDir, whose folder is gone) is pointed at it: IPython's lookups,
    its checks of existing folders and a new configurable's set-up and observers would cost a
    pooled process ~1 ms. Anywhere else (IPYTHONDIR unset or there already), IPython decides
    and makes them, as it would.
    """
    ipython_dir = _new_ipython_dir()
    values = getattr(profile, "_trait_values", None)
    if ipython_dir is None or STARTUP_README is None or not isinstance(values, dict):
        ipython_dir = get_ipython_dir()
        return ipython_dir, ProfileDir.create_profile_dir_by_name(ipython_dir, "default")
    assert profile is not None
    location = os.path.join(ipython_dir, "profile_default")
    os.mkdir(location, 0o755)  # ensure_dir_exists's mode
    paths = {"location": location, "static_dir": os.path.join(location, "static")}
    for trait, name, mode in PROFILE_FOLDERS:
        paths[trait] = os.path.join(location, name)
        os.mkdir(paths[trait], mode)
    readme, mode = STARTUP_README
    fd = os.open(os.path.join(paths["startup_dir"], "README"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, readme)
        os.fchmod(fd, mode)  # shutil.copy's copymode
    finally:
        os.close(fd)
    # The traits' new values, without their observers (which would make the folders again):
    # the location is set once, as ProfileDir allows, on the object made in the zygote.
    values.update(paths)
    return ipython_dir, profile


def _new_ipython_dir() -> str | None:
    """IPYTHONDIR as `get_ipython_dir()` returns it, made here if it is a new folder in an
    existing one; None when IPython's own lookup must decide (unset, there already, parent
    missing or not writable)."""
    ipython_dir = os.environ.get("IPYTHONDIR")
    if ipython_dir is None:
        return None
    ipython_dir = os.path.normpath(os.path.expanduser(ipython_dir))
    try:
        os.mkdir(ipython_dir)  # os.makedirs(ipdir, exist_ok=True)'s mode
    except OSError:
        return None
    return ipython_dir


def cell_compiler() -> ModuleType:
    """ipykernel's compiler module (compiler.py: os, tempfile and IPython's CachingCompiler
    only), loaded from its file without importing the ipykernel package."""
    loaded = sys.modules.get(COMPILER_MODULE)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("ipykernel")  # finds, does not import
    if package is None or package.origin is None:
        raise ImportError("ipykernel is not installed: its cell compiler names a cell's file")
    path = os.path.join(os.path.dirname(package.origin), "compiler.py")
    spec = importlib.util.spec_from_file_location(COMPILER_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[COMPILER_MODULE] = module
    spec.loader.exec_module(module)
    upstream = getattr(module, "murmur2_x86", None)
    if upstream is not None and all(murmur2_x86(text, seed) == upstream(text, seed)
                                    for text in MURMUR_SAMPLES for seed in (0, 0xC70F6907)):
        module.murmur2_x86 = murmur2_x86  # type: ignore[attr-defined]  # get_file_name looks it up
    return module


_WORDS = struct.Struct("<I")
# Texts the faster hash is checked against ipykernel's on before it replaces it: every tail
# length, non-ASCII (the hash is of the UTF-8 bytes), the empty cell.
MURMUR_SAMPLES = ("", "a", "ab", "abc", "abcd", "x = 1\n", "print('é中𝄞')\n" * 3,
                  "def main(a: int) -> dict:\n    return {'a': a}\n")


def murmur2_x86(data: str, seed: int) -> int:
    """ipykernel's murmur2_x86 (a cell's file name is this hash of its code), the same value
    computed word by word instead of character by character: ~2x faster, ~0.2 ms a 3 kB cell."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    raw = str.encode(data, "utf8")
    length = len(raw)
    h = seed ^ length
    rounded_end = length & 0xFFFFFFFC
    for (k,) in _WORDS.iter_unpack(raw[:rounded_end]):
        k = (k * m) & mask
        k ^= k >> 24
        h = ((h * m) & mask) ^ ((k * m) & mask)
    if length & 0x03:
        h = ((h ^ int.from_bytes(raw[rounded_end:], "little")) * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    return h ^ (h >> 15)


class Outbox:
    """Where a one-shot shell's messages go: the process's builder, on its channel, as answers
    to its request (`parent`), on IOPub topics named as a kernel names them."""

    def __init__(self, messages: Any, channel: Any, ident: str) -> None:
        self.messages, self.channel, self.ident = messages, channel, ident
        self.parent: dict[str, Any] = {}

    def topic(self, name: str) -> bytes:
        """An IOPub topic of this process (ipykernel's `kernel.<ident>.<name>`)."""
        return f"kernel.{self.ident}.{name}".encode()

    def send(self, msg_type: str, content: dict[str, Any], topic: str) -> dict[str, Any]:
        """One IOPub message answering the request."""
        return self.messages.send(self.channel, msg_type, content,  # type: ignore[no-any-return]
                                  parent=self.parent, ident=self.topic(topic))


class ChannelDisplayPublisher(DisplayPublisher):
    """display() and clear_output() as messages (ipykernel's ZMQDisplayPublisher's)."""

    outbox = Instance(Outbox, allow_none=True)

    def publish(self, data: dict[str, Any], metadata: dict[str, Any] | None = None,
                *args: Any, transient: dict[str, Any] | None = None, update: bool = False,
                **kwargs: Any) -> None:
        """A display_data (update_display_data for an update of a display id)."""
        self._validate_data(data, metadata)
        content = {"data": data, "metadata": {} if metadata is None else metadata,
                   "transient": {} if transient is None else transient}
        assert self.outbox is not None, "the process gives its shell an outbox"
        self.outbox.send("update_display_data" if update else "display_data", content,
                         "display_data")

    def clear_output(self, wait: bool = False) -> None:
        """A clear_output message."""
        assert self.outbox is not None, "the process gives its shell an outbox"
        self.outbox.send("clear_output", {"wait": wait}, "display_data")


class ChannelDisplayHook(DisplayHook):
    """A cell's last value as an execute_result message (ipykernel's ZMQShellDisplayHook's).

    `msg` is the result's content while one is being made (the shell's error handler reads
    it: an error while formatting the value fails the execution, as in a kernel)."""

    outbox = Instance(Outbox, allow_none=True)
    msg: dict[str, Any] | None = None

    def start_displayhook(self) -> None:
        """A result's content begins."""
        self.msg = {"data": {}, "metadata": {}}

    def write_output_prompt(self) -> None:
        """The execution count the result is numbered with."""
        if self.msg is not None:
            self.msg["execution_count"] = self.prompt_count

    def write_format_data(self, format_dict: dict[str, Any],
                          md_dict: dict[str, Any] | None = None) -> None:
        """The value's representations."""
        if self.msg is not None:
            self.msg["data"], self.msg["metadata"] = format_dict, md_dict

    def finish_displayhook(self) -> None:
        """Send the result (after the output written before it), if it has any data."""
        sys.stdout.flush()
        sys.stderr.flush()
        content, self.msg = self.msg, None
        if content is not None and content["data"] and self.outbox is not None:
            self.outbox.send("execute_result", content, "execute_result")


class ZMQInteractiveShell(Renewable, InteractiveShell):
    """IPython's shell for a one-shot process (named as ipykernel's: see the module's doc)."""

    displayhook_class = Type(ChannelDisplayHook)
    display_pub_class = Type(ChannelDisplayPublisher)
    readline_use = CBool(False)  # no terminal: as ipykernel's shell
    autoindent = CBool(False)
    exiter = Instance(ZMQExitAutocall)
    kernel = AnyTrait(None)  # a one-shot has no kernel object
    keepkernel_on_exit = None
    outbox = Instance(Outbox, allow_none=True)

    @default("exiter")
    def _default_exiter(self) -> ZMQExitAutocall:
        return ZMQExitAutocall(self)

    def attach(self, outbox: Outbox) -> None:
        """Send this shell's output through outbox (its display hook and publisher too)."""
        self.outbox = outbox
        self.displayhook.outbox = outbox
        self.display_pub.outbox = outbox

    def init_displayhook(self) -> None:
        """IPython's, the new hook sending through this shell's outbox (renew makes one)."""
        super().init_displayhook()
        self.displayhook.outbox = self.outbox

    def relocate(self) -> None:
        """In a forked process: the shell's directories are this process's (its IPython and
        profile dirs in the scratch, made here: `make_profile_dir`; home and starting dir, the
        directory history), its environment a notebook's, %store's database and the logger
        made from them on first use. Namespaces, history and hooks stay as the zygote built
        them: it left no trace in them (kernel/lean.py's warm-up), and the process's own start
        from here is a fork of that clean state (the full `renew` rebuilt them all: ~1.8 ms a
        process)."""
        self.ipython_dir, self.profile_dir = make_profile_dir(self.profile_dir)
        self.starting_dir = os.getcwd()
        self.home_dir = get_home_dir()
        self.dir_stack = []
        assert self.history_manager is not None, "built with the shell"
        self.history_manager.dir_hist[:] = [Path.cwd()]
        self.init_environment()
        self._renew_store_and_logger()

    def init_environment(self) -> None:
        """A notebook kernel's environment for the programs a cell starts."""
        os.environ.update(NOTEBOOK_ENVIRONMENT)

    def init_hooks(self) -> None:
        """IPython's hooks; paged text (`?`, %pdoc) goes into the reply, as a kernel's does."""
        super().init_hooks()
        self.set_hook("show_in_pager", page.as_hook(self.payloadpage_page), 99)

    def payloadpage_page(self, strg: Any, start: int = 0, screen_lines: int = 0,
                         pager_cmd: Any = None) -> None:
        """Page text as a reply payload (no pager: the caller shows it)."""
        data = strg if isinstance(strg, dict) else {"text/plain": strg}
        self.payload_manager.write_payload(  # type: ignore[union-attr]
            {"source": "page", "data": data, "start": max(0, start)})

    def ask_exit(self) -> None:
        """exit(): said in the reply's payload (a one-shot ends after its run anyway)."""
        self.exit_now = True
        self.payload_manager.write_payload(  # type: ignore[union-attr]
            {"source": "ask_exit", "keepkernel": self.keepkernel_on_exit})

    def set_next_input(self, text: str, replace: bool = False) -> None:
        """Text for the next cell, as a reply payload."""
        self.payload_manager.write_payload(  # type: ignore[union-attr]
            {"source": "set_next_input", "text": text, "replace": replace})

    def enable_gui(self, gui: Any = None) -> None:
        """Only the inline backend: a one-shot has no event loop to run a GUI's in."""
        if gui not in (None, "inline"):
            raise UsageError(f"a one-shot run has no event loop for the {gui!r} GUI; "
                             "figures are shown inline")
        self.active_eventloop = gui

    def _showtraceback(self, etype: type, evalue: BaseException, stb: list[str]) -> None:
        """The error message (after the output before it); the reply repeats the traceback."""
        sys.stdout.flush()
        sys.stderr.flush()
        if getattr(self.displayhook, "msg", None) is not None:
            # an error while formatting the value fails the execution (ipykernel's rule)
            self._last_traceback_during_displayhook = True
        if self.outbox is not None:
            self.outbox.send("error", {"traceback": stb, "ename": str(etype.__name__),
                                       "evalue": str(evalue)}, "error")
        self._last_traceback = stb


InteractiveShellABC.register(ZMQInteractiveShell)
