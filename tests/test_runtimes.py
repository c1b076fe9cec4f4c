"""Runtimes: an environment built from a requirements file, a kernelspec whose kernels run on
it (read-only to them, its modules preloaded by the fork server), updated without disturbing
the kernels running on it. Everything goes through the `sandbox-kernel runtime` command."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from sandbox_kernel.client import Sandbox

from .packages import make_wheel

CLI = [sys.executable, "-m", "sandbox_kernel", "runtime"]
NAME = "rt"


def runtime_cli(*args: str) -> subprocess.CompletedProcess:
    """`sandbox-kernel runtime ARGS` as an operator runs it."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          check=False)


def write_requirements(path: Path, wheels: Path, version: str) -> Path:
    path.write_text(f"--find-links {wheels}\nrtpkg=={version}\n")
    return path


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """Runtime `rt` with rtpkg 1.0, preloaded; removed at the end."""
    base = tmp_path_factory.mktemp("runtimes")
    wheels = base / "wheels"
    wheels.mkdir()
    for version in ("1.0", "2.0"):
        make_wheel(wheels, "rtpkg", version, {"rtpkg/__init__.py": f"VERSION = {version!r}\n",
                                              "rtpkg/extra.py": f"VERSION = {version!r}\n"})
    saved = os.environ.get("SANDBOX_KERNEL_RUNTIMES")
    os.environ["SANDBOX_KERNEL_RUNTIMES"] = str(base / "store")
    done = runtime_cli("create", NAME, "-r", str(write_requirements(
        base / "requirements.txt", wheels, "1.0")), "--preload", "rtpkg", "--user")
    assert done.returncode == 0, done.stderr[-2000:]
    yield {"base": base, "wheels": wheels, "created": done}
    runtime_cli("remove", NAME, "--force")
    if saved is None:
        os.environ.pop("SANDBOX_KERNEL_RUNTIMES")
    else:
        os.environ["SANDBOX_KERNEL_RUNTIMES"] = saved


def test_create_installs_a_kernelspec_and_records_the_packages(runtime):
    assert "Created runtime rt" in runtime["created"].stdout
    spec = KernelSpecManager().get_kernel_spec(f"sandbox-{NAME}")
    assert spec.display_name == "Python 3 (sandbox: rt)"
    assert spec.argv[0] == str(runtime["base"] / "store" / NAME / "builds" / "1" / "bin"
                               / "python")
    assert spec.metadata["kernel_provisioner"]["config"]["preload"] == ["rtpkg"]
    assert spec.metadata["sandbox_kernel"]["runtime"] == NAME
    shown = json.loads(runtime_cli("show", NAME).stdout)
    assert "rtpkg==1.0" in shown["packages"]
    assert any(line.startswith("ipykernel==") for line in shown["packages"])
    assert shown["requirements"][-1] == "rtpkg==1.0"
    listed = json.loads(runtime_cli("list", "--json").stdout)
    assert [(row["name"], row["build"], row["kernels"]) for row in listed] == [(NAME, 1, 0)]


def test_a_kernel_on_the_runtime_imports_its_preloaded_package_and_cannot_change_it(runtime):
    with Sandbox(f"sandbox-{NAME}") as sb:
        done = sb.run("import sys\npreloaded = 'rtpkg' in sys.modules\nimport rtpkg\n"
                      "print(preloaded, rtpkg.VERSION)\n"
                      "open(rtpkg.__file__, 'a')")
        assert done.stdout == "True 1.0\n"
        assert done.error.name == "PermissionError"
        assert "Errno 13" in done.error.value
        done = sb.run("import os, rtpkg\nos.mkdir(os.path.join(os.path.dirname("
                      "rtpkg.__file__), 'planted'))")
        assert done.error.name == "PermissionError"
        assert sb.run("print(1 + 1)").stdout == "2\n"  # alive
    site = next((runtime["base"] / "store" / NAME / "builds" / "1").glob(
        "lib/python*/site-packages"))
    assert not (site / "rtpkg" / "planted").exists()


def test_the_default_kernel_does_not_see_the_runtimes_packages(runtime, sandbox):
    done = sandbox.run("import rtpkg")
    assert done.error.name == "ModuleNotFoundError"


TOKEN = "https://user:index-token-0123456789@packages.invalid/simple"


@pytest.fixture
def store_in_the_prefix():
    """A runtime's files where runtimes live by default: this environment's data directory,
    inside sys.prefix, which every default kernel's Landlock grants cover."""
    store = Path(sys.prefix) / "share" / "sandbox-kernel" / "runtimes"
    made = not store.exists()
    runtime = store / "planted-probe"
    (runtime / "builds" / "1").mkdir(parents=True)
    (runtime / "requirements.txt").write_text(f"--extra-index-url {TOKEN}\nrtpkg\n")
    (runtime / "runtime.json").write_text(json.dumps({"name": "planted-probe",
                                                      "source": "/srv/secret/reqs.txt"}))
    (runtime / "builds" / "1" / "frozen.txt").write_text("rtpkg==1.0\n")
    yield store
    shutil.rmtree(store if made else runtime)


def test_a_kernel_cannot_read_the_runtimes_in_its_prefix(store_in_the_prefix, kernelspecs):
    runtime = store_in_the_prefix / "planted-probe"
    targets = [runtime / "requirements.txt", runtime / "runtime.json",
               runtime / "builds" / "1" / "frozen.txt"]
    with Sandbox("sandbox") as sb:  # started after the files exist, as a service's kernels
        for target in targets:
            done = sb.run(f"open({str(target)!r}).read()")
            assert done.error is not None and done.error.name == "PermissionError", done
            assert "[Errno 13]" in done.error.value
        for listed in (store_in_the_prefix, runtime, store_in_the_prefix.parent):
            done = sb.run(f"import os\nos.listdir({str(listed)!r})")
            assert done.error is not None and done.error.name == "PermissionError", done
        # Obvious bypasses: another spelling of the path, a link made in the scratch.
        sneaky = f"{sys.prefix}/share/./sandbox-kernel/../sandbox-kernel/runtimes"
        done = sb.run(f"open({sneaky + '/planted-probe/requirements.txt'!r}).read()")
        assert done.error is not None and done.error.name == "PermissionError"
        done = sb.run(f"import os\nos.symlink({str(runtime)!r}, 'link')\n"
                      "open('link/requirements.txt').read()")
        assert done.error is not None and done.error.name == "PermissionError"
        # The rest of the prefix is as readable as before (the folders on the way to the
        # store are not listed, their other contents are; Jupyter's kernelspecs and config,
        # share/jupyter, are not granted since #31), and the kernel lives.
        kept = sb.run(f"import os\nsorted(os.listdir({sys.prefix + '/lib'!r}))")
        assert kept.error is None and f"'python{sys.version_info[0]}." in kept.text, kept
        assert sb.run("import ipykernel, json\nprint(2)").stdout == "2\n"


def test_update_refuses_under_a_running_kernel_then_forced_new_kernels_get_the_new(runtime):
    requirements = write_requirements(runtime["base"] / "requirements-2.txt",
                                      runtime["wheels"], "2.0")
    with Sandbox(f"sandbox-{NAME}") as old:
        assert old.run("import rtpkg; print(rtpkg.VERSION)").stdout == "1.0\n"
        refused = runtime_cli("update", NAME, "-r", str(requirements))
        assert refused.returncode == 1
        assert "1 kernel(s) run on runtime 'rt'" in refused.stderr
        assert "--force" in refused.stderr
        assert json.loads(runtime_cli("show", NAME).stdout)["build"] == 1

        forced = runtime_cli("update", NAME, "-r", str(requirements), "--force")
        assert forced.returncode == 0, forced.stderr[-2000:]
        assert "+ rtpkg==2.0" in forced.stdout and "- rtpkg==1.0" in forced.stdout
        with Sandbox(f"sandbox-{NAME}") as new:
            assert new.run("import rtpkg; print(rtpkg.VERSION)").stdout == "2.0\n"
        # The running kernel keeps its environment, down to modules it had not imported yet.
        assert old.run("import rtpkg.extra; print(rtpkg.extra.VERSION)").stdout == "1.0\n"
    shown = json.loads(runtime_cli("show", NAME).stdout)
    assert shown["build"] == 2 and "rtpkg==2.0" in shown["packages"]
    assert shown["builds"] == [1, 2]  # build 1 stays until no kernel runs on it
    shown_list = json.loads(runtime_cli("list", "--json").stdout)
    assert shown_list[0]["kernels"] == 0


def test_bad_names_and_missing_files_are_refused_and_leave_nothing(runtime, tmp_path):
    bad = runtime_cli("create", "Bad/Name", "-r", str(tmp_path / "none.txt"))
    assert bad.returncode == 1 and "invalid runtime name 'Bad/Name'" in bad.stderr
    missing = runtime_cli("create", "other", "-r", str(tmp_path / "none.txt"))
    assert missing.returncode == 1
    assert "cannot read the requirements file" in missing.stderr
    assert not (runtime["base"] / "store" / "other").exists()
    again = runtime_cli("create", NAME, "-r", str(tmp_path / "none.txt"))
    assert again.returncode == 1 and "exists already" in again.stderr
    unknown = runtime_cli("show", "nope")
    assert unknown.returncode == 1 and "no runtime named 'nope'" in unknown.stderr


def test_remove_takes_the_kernelspec_and_the_environment(runtime):  # runs last: ends rt
    done = runtime_cli("remove", NAME)
    assert done.returncode == 0, done.stderr
    assert f"sandbox-{NAME}" not in KernelSpecManager().find_kernel_specs()
    assert not (runtime["base"] / "store" / NAME).exists()
    assert json.loads(runtime_cli("list", "--json").stdout) == []


@pytest.mark.timeout(900)  # four builds
def test_by_default_a_runtime_preloads_what_it_installs_and_says_what_it_skipped(tmp_path):
    """No --preload: every top-level module the requirements install that imports cleanly,
    each measured; private names, tests, failing and thread-starting imports skipped."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "autobase", "1.0", {"autobase/__init__.py": "X = 1\n"})
    make_wheel(wheels, "autouser", "1.0", {
        "autouser/__init__.py": "import autobase\n", "autosolo.py": "Y = 2\n",
        "_autoprivate.py": "", "tests/__init__.py": "",
        "autobroken/__init__.py": "raise RuntimeError('no display here')\n",
        "autothreads/__init__.py": "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"},
        requires=("autobase",))
    (tmp_path / "requirements.txt").write_text(f"--find-links {wheels}\nautouser\n")
    saved = os.environ.get("SANDBOX_KERNEL_RUNTIMES")
    os.environ["SANDBOX_KERNEL_RUNTIMES"] = str(tmp_path / "store")
    try:
        done = runtime_cli("create", "auto", "-r", str(tmp_path / "requirements.txt"),
                           "--user")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Preloads autobase, autosolo, autouser (what it installs;" in done.stdout
        assert "not preloaded: autobroken: RuntimeError: no display here" in done.stdout
        shown = json.loads(runtime_cli("show", "auto").stdout)
        assert shown["preload"] == ["autobase", "autosolo", "autouser"]
        assert shown["preload_from"] == "installed"
        assert shown["preload_modules"]["autouser"]["loads"] == ["autobase", "autouser"]
        assert shown["preload_modules"]["autosolo"]["loads"] == ["autosolo"]
        skipped = shown["preload_skipped"]
        assert skipped["_autoprivate"] == "a private module"
        assert skipped["tests"] == "a test package"
        assert skipped["autobroken"] == "RuntimeError: no display here"
        assert "starts 1 thread(s)" in skipped["autothreads"]
        assert "ipykernel" not in shown["preload"] + list(skipped)  # the kernel's own: left out
        spec = KernelSpecManager().get_kernel_spec("sandbox-auto")
        assert spec.metadata["kernel_provisioner"]["config"]["preload"] == shown["preload"]
        with Sandbox("sandbox-auto") as sb:  # a session starts with them loaded
            done = sb.run("import sys\nprint(sorted(m for m in ('autobase', 'autosolo', "
                          "'autouser', 'autobroken') if m in sys.modules))")
            assert done.stdout == "['autobase', 'autosolo', 'autouser']\n", done

        off = runtime_cli("update", "auto", "--no-preload", "--force")
        assert off.returncode == 0, off.stderr[-2000:]
        assert "Preloads nothing (--no-preload)" in off.stdout
        shown = json.loads(runtime_cli("show", "auto").stdout)
        assert (shown["preload"], shown["preload_from"]) == ([], "none")
        refused = runtime_cli("update", "auto", "--preload", "autobroken", "--force")
        assert refused.returncode == 1
        assert "autobroken: RuntimeError: no display here" in refused.stderr
        back = runtime_cli("update", "auto", "--preload-installed", "--force")
        assert back.returncode == 0, back.stderr[-2000:]
        assert json.loads(runtime_cli("show", "auto").stdout)["preload"] == [
            "autobase", "autosolo", "autouser"]
    finally:
        runtime_cli("remove", "auto", "--force")
        if saved is None:
            os.environ.pop("SANDBOX_KERNEL_RUNTIMES")
        else:
            os.environ["SANDBOX_KERNEL_RUNTIMES"] = saved
