"""The service's settings: flags, dify-sandbox's variables, defaults, and bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from traitlets import TraitError

from tests.helpers import write_keys

from .helpers import free_port


def _settings(argv: list[str], environ: dict[str, str]):
    import argparse

    from sandbox_kernel.service import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_arguments(parser.parse_args(argv), environ)


def test_settings_flag_beats_variable_beats_default():
    assert _settings([], {}).port == 8194
    assert _settings([], {}).api_key is None  # unset: decided by auth.dify_key
    assert _settings([], {"SANDBOX_PORT": "9000"}).port == 9000
    assert _settings(["--port", "9001"], {"SANDBOX_PORT": "9000"}).port == 9001
    settings = _settings([], {"MAX_WORKERS": "2", "MAX_REQUESTS": "7", "WORKER_TIMEOUT": "15",
                              "ENABLE_NETWORK": "false", "API_KEY": "k" * 16})
    assert (settings.max_workers, settings.max_requests, settings.worker_timeout,
            settings.enable_network, settings.api_key) == (2, 7, 15.0, False, "k" * 16)
    assert _settings(["--enable-network"], {"ENABLE_NETWORK": "false"}).enable_network is True


@pytest.mark.parametrize("argv, environ, named", [
    ([], {"MAX_WORKERS": "many"}, "MAX_WORKERS"),
    ([], {"ENABLE_NETWORK": "maybe"}, "ENABLE_NETWORK"),
    (["--max-requests", "0"], {}, "max-requests"),
    ([], {"SANDBOX_PORT": "70000"}, "port")])
def test_bad_settings_name_the_setting(argv, environ, named):
    from traitlets import TraitError

    with pytest.raises(TraitError, match=named):
        _settings(argv, environ)


def _serve_refusal(keys: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve", "--api-keys-file",
                           str(keys), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_serve_refuses_a_bad_keys_file(tmp_path):
    keys = write_keys(tmp_path / "keys.json", [{"id": "a", "key": "short"}])
    assert "keys[0]: key must be a string of at least 16 characters" in _serve_refusal(keys)
    example = Path(__file__).parents[2] / "examples" / "mcp" / "keys.json"  # published keys
    copy = tmp_path / "copied.json"
    copy.write_bytes(example.read_bytes())
    copy.chmod(0o600)
    assert "the key is the published example's placeholder" in _serve_refusal(copy)


def test_serve_refuses_a_keys_file_others_may_read(tmp_path):
    # As --secrets-file: the keys in it run code, so only its owner may read it.
    keys = write_keys(tmp_path / "keys.json", [{"id": "a", "key": "k" * 32}])
    keys.chmod(0o644)
    assert _serve_refusal(keys) == (
        f"sandbox-kernel serve: the API keys file {keys}: mode 0644 lets others read it; make "
        f"it readable by its owner only (chmod 600 {keys})\n")


@pytest.mark.parametrize("argv, environ, says", [
    ([], {"API_KEY": ""}, "is empty"),
    ([], {"API_KEY": "   "}, "is empty"),
    (["--api-key="], {}, "is empty"),
    (["--api-key", "short-key"], {}, "has 9 characters"),
    ([], {"API_KEY": "0123456789abcde"}, "has 15 characters")])
def test_a_key_that_anyone_could_guess_is_refused(argv, environ, says):
    from traitlets import TraitError

    with pytest.raises(TraitError, match=says):
        _settings(argv, environ)


def test_which_key_the_dify_routes_take_and_what_start_up_says():
    from sandbox_kernel.hosting.keys import dify_key, insecure_key_warning

    assert dify_key(None, "") == "dify-sandbox"
    assert "can run code" in insecure_key_warning("dify-sandbox", "", "0.0.0.0")
    assert "anyone who can reach this port" in insecure_key_warning("dify-sandbox", "", "")
    # A keys file means real keys: the public default opens nothing, and start-up says so.
    assert dify_key(None, "keys.json") is None
    assert "are OFF" in insecure_key_warning(None, "keys.json", "127.0.0.1")
    assert "can run code" in insecure_key_warning("dify-sandbox", "keys.json", "127.0.0.1")
    assert insecure_key_warning("k" * 16, "", "0.0.0.0") is None


def test_session_timeout_and_nodejs_upstream_settings():
    assert _settings([], {}).session_timeout == 60.0
    assert _settings([], {"SANDBOX_SESSION_TIMEOUT": "120"}).session_timeout == 120.0
    assert _settings([], {"SANDBOX_NODEJS_UPSTREAM": "http://sandbox:8194"}
                     ).nodejs_upstream == "http://sandbox:8194"
    from traitlets import TraitError

    with pytest.raises(TraitError, match="session-timeout 400 s is above max-timeout 300 s"):
        _settings(["--session-timeout", "400"], {})
    with pytest.raises(TraitError, match="nodejs-upstream 'sandbox:8194': expected an http://"):
        _settings(["--nodejs-upstream", "sandbox:8194"], {})


def test_the_sessions_default_timeout_follows_a_lower_max_timeout():
    assert _settings(["--max-timeout", "10"], {}).session_timeout == 10
    assert _settings([], {}).session_timeout == 60
    with pytest.raises(TraitError, match="session-timeout 20 s is above max-timeout 10 s"):
        _settings(["--max-timeout", "10", "--session-timeout", "20"], {})
