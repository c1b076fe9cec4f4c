"""The command-line parser a fork server builds once parses exactly as traitlets' own would.

A fork-served kernel takes the server's parser instead of building one (kernel/parser_cache.py,
`PrebuiltParser.prebuild_parser`); these tests parse the same command lines both ways and
compare everything parsing leaves on the application.
"""

import pytest
from traitlets.config import Config

from sandbox_kernel.kernel.app import SandboxKernelApp
from sandbox_kernel.kernel.parser_cache import PrebuiltParser

COMMAND_LINES = [
    ["-f", "/tmp/kernel-1.json", "--IPKernelApp.parent_handle=1"],
    ["-f", "/tmp/kernel-2.json", "--memory-limit=256M", "--timeout", "5", "--read-path=/srv",
     "--read-path=/opt", "--pass-env=TZ", "--allow-network", "--HistoryManager.hist_file=x",
     "--SandboxPolicy.env=A=1", "--debug", "--", "extra", "-x"],
    ["--no-seccomp", "--no-landlock", "--run-as", "root", "--cpu-limit=3"],
]


def _parsed(argv, prebuilt):
    PrebuiltParser.discard_prebuilt()
    if prebuilt:
        SandboxKernelApp.prebuild_parser()
    app = SandboxKernelApp()
    app.parse_command_line(argv)
    taken = not PrebuiltParser.prebuilt_pending()
    return app, taken


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_the_prebuilt_parser_parses_as_a_fresh_one(argv):
    fresh, _ = _parsed(argv, prebuilt=False)
    reused, taken = _parsed(argv, prebuilt=True)
    assert taken  # the prebuilt parser was used, and only once
    assert reused.cli_config == fresh.cli_config
    assert isinstance(reused.cli_config, Config) and reused.cli_config
    assert reused.config == fresh.config
    assert reused.extra_args == fresh.extra_args
    assert reused.policy.as_dict() == fresh.policy.as_dict()


def test_a_second_application_builds_its_own_parser():
    _, taken = _parsed(["--memory-limit=1G"], prebuilt=True)
    assert taken
    second = SandboxKernelApp()
    second.parse_command_line(["--cpu-limit=2"])  # no flag of the first parse carried over
    assert "memory_limit" not in second.config.SandboxPolicy
    assert second.policy.cpu_limit == 2


def test_a_bad_option_is_refused_as_before():
    for prebuilt in (False, True):
        with pytest.raises(SystemExit):
            _parsed(["--memory-limit"], prebuilt=prebuilt)


def test_the_prebuilt_class_list_is_the_one_traitlets_makes():
    PrebuiltParser.discard_prebuilt()
    fresh = list(SandboxKernelApp()._classes_with_config_traits())
    SandboxKernelApp.prebuild_parser()
    try:
        assert list(SandboxKernelApp()._classes_with_config_traits()) == fresh
        some = [SandboxKernelApp.classes[0]]  # a given list is never the prebuilt one
        assert list(SandboxKernelApp()._classes_with_config_traits(some)) != fresh
    finally:
        PrebuiltParser.discard_prebuilt()
