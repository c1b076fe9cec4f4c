"""sandbox_kernel.client's public API, pinned (as in jupyter_client's test_public_api.py)."""

import inspect

import pytest

import sandbox_kernel.client as client

PUBLIC = ["GRACE_SECONDS", "AsyncSandbox", "CallerLimits", "ErrorInfo", "Execution", "Sandbox",
          "Snapshot", "SnapshotError", "ToolCall", "ToolLimits", "Usage"]
METHODS = ["start", "close", "restart", "interrupt", "kernel_info", "warm_up", "run", "install",
           "snapshot", "restore"]


def test_all_lists_the_public_names():
    assert sorted(client.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(client, name) is not None


def test_star_import_gives_exactly_all():
    names: dict = {}
    exec("from sandbox_kernel.client import *", names)
    assert sorted(name for name in names if name != "__builtins__") == sorted(PUBLIC)


def test_execution_error_is_a_deprecated_alias_of_error_info():
    with pytest.warns(DeprecationWarning, match="ErrorInfo"):
        from sandbox_kernel.client import ExecutionError
    assert ExecutionError is client.ErrorInfo
    assert not issubclass(client.ErrorInfo, BaseException)  # data, as its new name says
    with pytest.raises(ImportError):
        from sandbox_kernel.client import NoSuchName  # noqa: F401


@pytest.mark.parametrize("name", METHODS)
def test_both_sandboxes_have_each_method_with_one_signature(name):
    blocking, awaited = getattr(client.Sandbox, name), getattr(client.AsyncSandbox, name)
    assert not inspect.iscoroutinefunction(blocking)
    assert inspect.iscoroutinefunction(awaited)
    assert inspect.signature(blocking) == inspect.signature(awaited)
    assert blocking.__name__ == awaited.__name__ == name
    assert blocking.__doc__ and blocking.__doc__ == awaited.__doc__


def test_run_keeps_its_arguments():
    parameters = list(inspect.signature(client.Sandbox.run).parameters)
    assert parameters == ["self", "code", "inputs", "timeout", "on_stdout", "on_stderr",
                          "on_display", "entrypoint", "raw_result", "tools"]


def test_settings_are_constructor_arguments():
    parameters = inspect.signature(client.Sandbox).parameters
    for name in ("kernel_name", "policy", "startup_timeout", "grace", "max_output",
                 "max_result", "cold_start", "preload", "timeout_source", "one_shot", "tools",
                 "tool_limits", "approve_tool", "audit_tool_payloads"):
        assert name in parameters, name
    assert inspect.signature(client.AsyncSandbox).parameters == parameters
    sandbox = client.Sandbox(None, timeout_source="my --limit", one_shot=True)
    assert (sandbox.timeout_source, sandbox.one_shot) == ("my --limit", True)


def test_context_managers():
    assert hasattr(client.Sandbox, "__enter__") and hasattr(client.Sandbox, "__exit__")
    assert inspect.iscoroutinefunction(client.AsyncSandbox.__aenter__)
    assert inspect.iscoroutinefunction(client.AsyncSandbox.__aexit__)
