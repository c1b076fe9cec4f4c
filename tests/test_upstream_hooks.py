"""The upstream internals this package overrides or calls are still there, and still used.

ipykernel, jupyter_client, traitlets, IPython and the standard library have no public hook for
some of what the sandbox changes (docs/architecture.md lists each one and why). A release that
renames one would not fail loudly: an override would silently stop being called (a kernel would
then bind its channels inside its private network namespace, signal its process group, or scan
/proc at shutdown), a call would raise only on the path that makes it. These tests name every
such internal, check that it exists with the arguments this package gives it, and, where that
is cheap, that upstream still calls the hook (in this process, no kernel needed); the behaviour
each one buys is tested where the feature is (see the map in docs/architecture.md).
"""

from __future__ import annotations

import _posixsubprocess
import atexit
import inspect
import os
import socket
import subprocess

import pytest
import zmq
from ipykernel.heartbeat import Heartbeat
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel
from IPython.core.compilerop import CachingCompiler
from jupyter_client import connect
from jupyter_client.client import KernelClient
from jupyter_client.connect import ConnectionFileMixin
from jupyter_client.manager import AsyncKernelManager, KernelManager
from jupyter_client.provisioning import LocalProvisioner
from jupyter_client.session import Session
from traitlets import Float
from traitlets.config.application import Application
from traitlets.config.loader import KVArgParseConfigLoader

from sandbox_kernel.kernel import app as kernel_app
from sandbox_kernel.kernel import peeking
from sandbox_kernel.kernel.app import SandboxHeartbeat, SandboxKernelApp
from sandbox_kernel.kernel.kernel import SandboxKernel
from sandbox_kernel.kernel.oneshot import ChannelSession
from sandbox_kernel.kernel.parser_cache import PrebuiltParser

# (upstream class, private method, our class that overrides it)
OVERRIDES = [
    (IPythonKernel, "_publish_execute_input", SandboxKernel),
    (Kernel, "_send_interrupt_children", SandboxKernel),
    (Kernel, "_process_children", SandboxKernel),
    (IPKernelApp, "_try_bind_socket", SandboxKernelApp),
    (Heartbeat, "_try_bind_socket", SandboxHeartbeat),
    (ConnectionFileMixin, "_ip_default", SandboxKernelApp),
    (Application, "_classes_with_config_traits", PrebuiltParser),
    (Application, "_create_loader", PrebuiltParser),
    (Session, "deserialize", peeking.PeekingSession),
    (Session, "sign", peeking.PeekingSession),
    (Session, "msg", ChannelSession),
    (Session, "serialize", ChannelSession),
]


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


@pytest.mark.parametrize(("upstream", "name", "ours"), OVERRIDES,
                         ids=[f"{up.__name__}.{name}" for up, name, _ in OVERRIDES])
def test_each_overridden_method_exists_upstream_with_our_arguments(upstream, name, ours):
    original = inspect.getattr_static(upstream, name)
    assert callable(original), f"{upstream.__qualname__}.{name} is gone: see docs/architecture.md"
    assert _parameters(getattr(upstream, name)) == _parameters(getattr(ours, name))
    assert getattr(ours, name) is not getattr(upstream, name)  # ours is the one that runs


def test_the_private_calls_we_make_still_exist():
    # kernel/main_call.py: an interrupt cancels an async main() as ipykernel does for cells,
    # and the result goes out on ipykernel's own IOPub topic.
    assert _parameters(IPythonKernel._cancel_on_sigint) == ["self", "future"]
    assert _parameters(Kernel._topic) == ["self", "topic"]
    # kernel/kernel.py: the pause before each reply, zero for main() calls.
    assert isinstance(Kernel.class_traits()["_execute_sleep"], Float)
    # kernel/app.py: the debugger's loop-back socket, replaced by one never connected.
    assert "debug_shell_socket" in IPKernelApp.class_traits()
    # confine/denials.py: subprocess starts children through its copy of fork_exec.
    assert subprocess._fork_exec is _posixsubprocess.fork_exec  # type: ignore[attr-defined]
    # launch/forkserver/server.py: a forked kernel runs atexit callbacks as an exit would.
    assert callable(atexit._run_exitfuncs)  # type: ignore[attr-defined]
    # kernel/parser_cache.py: a loader's parser is built by this step, which a prebuilt one
    # replaces.
    loader = KVArgParseConfigLoader([], {}, {}, classes=[])
    loader._create_parser()
    assert loader.parser is not None and isinstance(loader.argparse_traits, dict)
    # launch/provisioner.py: a forked kernel stands in for LocalProvisioner's Popen.
    for name in ("process", "pid", "pgid"):
        assert hasattr(LocalProvisioner, name)


def test_ipykernels_iopub_pipe_warning_is_worded_as_we_filter_it():
    # kernel/app.py filters this warning by its text: reworded, it would print at every start.
    import ipykernel.iostream

    assert "Couldn't bind IOPub Pipe" in inspect.getsource(ipykernel.iostream.IOPubThread)


def test_jupyter_client_still_wraps_start_and_shutdown_in_its_pending_state():
    # client/managers.py unwraps these to leave out in_pending_state's 10 ms sleep.
    for manager in (KernelManager, AsyncKernelManager):
        for name in ("_async_start_kernel", "_async_shutdown_kernel"):
            assert hasattr(getattr(manager, name), "__wrapped__"), f"{manager.__name__}.{name}"
    fresh = KernelManager()
    assert fresh._attempted_start is False and fresh._ready is None


def test_a_client_creates_its_optional_channels_only_when_asked():
    # client/managers.py stops only these three when they were opened.
    client = KernelClient()
    assert (client._stdin_channel, client._hb_channel, client._control_channel) == (None,) * 3


def test_ipython_maps_each_cell_name_in_its_compiler():
    # kernel/kernel.py: a warm-up leaves no cell name in this map.
    compiler = CachingCompiler()
    name = compiler.cache("x = 1\n", number=7)
    assert compiler._filename_map[name] == 7


def test_the_matplotlib_cache_decorator_the_fork_server_reapplies():
    matplotlib = pytest.importorskip("matplotlib")
    assert callable(matplotlib._logged_cached)
    for name in ("get_configdir", "get_cachedir"):
        assert callable(getattr(matplotlib, name).__wrapped__)


def test_the_ip_default_is_loopback_without_scanning_the_host(monkeypatch):
    def scan():
        raise AssertionError("jupyter_client listed the host's interfaces")

    monkeypatch.setattr(connect, "localhost", scan)
    app = SandboxKernelApp()
    assert app.ip == "127.0.0.1"  # traitlets still takes `_ip_default` as the dynamic default
    app.load_connection_info({"ip": "127.0.0.2", "transport": "tcp"})
    assert app.ip == "127.0.0.2"


def _listener() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


def test_ipykernel_binds_each_channel_through_try_bind_socket():
    """The prebound listener (made before the namespace move) is the one libzmq listens on."""
    listener, port = _listener()
    app = SandboxKernelApp()
    app.prebound = {port: listener}
    context = zmq.Context()
    try:
        router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        assert app._bind_socket(router, port) == port
        assert app.prebound == {}  # taken: a bind of its own would have failed, port in use
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.poll(5000) and router.recv_multipart()[-1] == b"hello"
    finally:
        context.destroy(linger=0)


def test_ipykernel_starts_the_heartbeat_class_named_in_its_module():
    """init_heartbeat builds `kernelapp.Heartbeat`: the swap makes it bind the prebound port."""
    listener, port = _listener()
    app = SandboxKernelApp()
    app.prebound, app.hb_port = {port: listener}, port
    app.init_heartbeat()
    context = zmq.Context()
    try:
        assert isinstance(app.heartbeat, SandboxHeartbeat)
        assert app.heartbeat.bound.wait(10) and app.prebound == {}
        assert kernel_app.kernelapp.Heartbeat is Heartbeat  # put back after the call
        ping = context.socket(zmq.REQ)
        ping.connect(f"tcp://127.0.0.1:{port}")
        ping.send(b"ping")
        assert ping.poll(5000) and ping.recv() == b"ping"
    finally:
        context.destroy(linger=0)
        app.heartbeat.context.term()  # the heartbeat thread ends on ETERM
        app.heartbeat.join(10)


def test_ipykernel_still_tracks_pending_output_by_these_names():
    # kernel/output.py flushes only when one of these is set.
    from ipykernel.iostream import IOPubThread, OutStream

    context = zmq.Context()
    try:
        thread = IOPubThread(context.socket(zmq.PUB))
        stream = OutStream(Session(), thread, "stdout", watchfd=False)
        assert (stream._flush_pending, stream._subprocess_flush_pending) == (False, False)
        stream.write("x")
        assert stream._flush_pending is True
        stream.close()
        thread.close()
    finally:
        context.destroy(linger=0)


def test_the_in_process_pip_entry_points_are_where_kernel_pip_imports_them():
    pytest.importorskip("pip")
    from pip._internal.cli.main import main
    from pip._internal.index.collector import LinkCollector
    from pip._internal.index.package_finder import PackageFinder
    from pip._internal.models.index import PyPI
    from pip._internal.models.search_scope import SearchScope
    from pip._internal.models.selection_prefs import SelectionPreferences
    from pip._internal.network import session

    assert callable(main) and callable(session.user_agent) and PyPI.simple_url
    assert all(callable(getattr(cls, "create", None))
               for cls in (LinkCollector, PackageFinder, SearchScope))
    assert "allow_yanked" in _parameters(SelectionPreferences)
    assert issubclass(session.PipSession, object)


def test_a_main_call_publishes_no_execute_input_and_a_cell_does(sandbox):
    """kernel/kernel.py's _publish_execute_input override, seen from the client."""
    client = sandbox.client

    def published(metadata: dict) -> list[str]:
        msg = client.session.msg("execute_request", {
            "code": "def main():\n    return {}\n", "silent": False, "store_history": False,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        msg["metadata"]["sandbox"] = metadata
        client.shell_channel.send(msg)
        kinds = []
        while True:
            message = client.get_iopub_msg(timeout=30)
            if message["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                continue
            if message["msg_type"] == "status" and \
                    message["content"]["execution_state"] == "idle":
                break
            kinds.append(message["msg_type"])
        while client.get_shell_msg(timeout=30)["parent_header"].get("msg_id") != \
                msg["header"]["msg_id"]:
            pass
        return kinds

    assert "execute_input" in published({})
    assert "execute_input" not in published({"entrypoint": "main", "inputs": {}})
    sandbox.run("globals().pop('main', None)")


def test_a_session_made_before_a_fork_is_the_forks_once_its_pid_and_count_are_reset():
    """OneShotKernel.renew (kernel/oneshot.py) sets a pooled process's Session.pid: Session.send
    drops, with a warning, what another process than the one that made the session sends; and
    resets message_count, which numbers the message ids."""
    from jupyter_client.session import Session

    session = Session(key=b"")
    assert session.check_pid and session.pid == os.getpid()
    session.session, session.message_count = "renewed", 0
    assert session.msg_id == f"renewed_{os.getpid()}_0" and session.message_count == 1


def test_a_profile_dir_made_in_few_calls_is_the_one_ipython_makes(tmp_path, monkeypatch):
    """kernel/lean_shell.py's make_profile_dir: the folders, modes and startup README that
    get_ipython_dir() and ProfileDir.create_profile_dir_by_name make, and a ProfileDir whose
    traits (in `_trait_values`, set without its observers) name them."""
    from IPython.core.profiledir import ProfileDir
    from IPython.paths import get_ipython_dir

    from sandbox_kernel.kernel import lean_shell

    def tree(top):
        return sorted((os.path.relpath(os.path.join(folder, name), top),
                       os.lstat(os.path.join(folder, name)).st_mode,
                       open(os.path.join(folder, name), "rb").read() if name in files else b"")
                      for folder, folders, files in os.walk(top) for name in folders + files)

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython" / ".ipython"))
    (tmp_path / "ipython").mkdir()
    ipythons = ProfileDir.create_profile_dir_by_name(get_ipython_dir(), "default")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ours" / ".ipython"))
    (tmp_path / "ours").mkdir()
    zygotes = ProfileDir(location=str(tmp_path / "zygote"))
    ipython_dir, ours = lean_shell.make_profile_dir(zygotes)
    assert ours is zygotes and ipython_dir == str(tmp_path / "ours" / ".ipython")
    assert tree(tmp_path / "ours") == tree(tmp_path / "ipython")
    for trait in ("location", "security_dir", "log_dir", "startup_dir", "pid_dir", "static_dir"):
        assert getattr(ours, trait) == getattr(ipythons, trait).replace(
            str(tmp_path / "ipython"), str(tmp_path / "ours"))
    # IPYTHONDIR there already: IPython's own lookup and ProfileDir, as before
    again_dir, again = lean_shell.make_profile_dir(zygotes)
    assert again_dir == ipython_dir and again is not zygotes
    assert again.location == ours.location
    with pytest.raises(RuntimeError):  # the location is still set once only
        ours.location = str(tmp_path)


def test_the_lean_compilers_cell_names_are_ipykernels():
    """kernel/lean_shell.py replaces ipykernel's murmur2_x86 (a cell's file name) in its copy
    of ipykernel's compiler module with one computing the same hash faster."""
    import random

    from ipykernel.compiler import murmur2_x86

    from sandbox_kernel.kernel import lean_shell

    assert lean_shell.cell_compiler().murmur2_x86 is lean_shell.murmur2_x86
    rng = random.Random(48)
    alphabet = "abc xyz\n\t=()[]{}:;,.'\"é中𝄞\x00\x7f"
    for length in [*range(40), 100, 1000, 4099]:
        for _ in range(20):
            text = "".join(rng.choice(alphabet) for _ in range(length))
            assert lean_shell.murmur2_x86(text, 0xC70F6907) == murmur2_x86(text, 0xC70F6907)
