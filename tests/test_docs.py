"""The docs' commands work as a newcomer types them.

Shell blocks marked `<!-- runnable ... -->` in README.md and docs/deploy.md are run as written, in
a copy of the checkout, with a fresh HOME, each file's blocks in order in one directory; the one
in docs/secrets.md with this checkout's installed command, in a folder of its own. The
README's set-up runs on Debian's own /usr/bin/python3 where it exists (the interpreter a new user
of a Debian or Ubuntu machine has). Every `pip install` of this package in any doc installs it
from the checkout or a wheel built there: it is on no package index.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .ci_tools import unavailable

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "deploy").rglob("*.md"))]
RUNNABLE = re.compile(r"<!-- runnable[^>]*-->\n```(?:bash|sh)\n(.*?)```", re.S)
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)
DEBIAN_PYTHON = Path("/usr/bin/python3")
SETUP_TIMEOUT = 600  # seconds: a fresh venv, its packages from pip's cache, then the job


def runnable_blocks(doc: Path) -> list[str]:
    """The doc's shell blocks marked runnable, in order."""
    return RUNNABLE.findall(doc.read_text())


def checkout_copy(target: Path) -> Path:
    """The checkout's tracked files (what a clone has), without its venvs and build output."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            source, copy = ROOT / name, target / name
            if source.is_file():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, copy)
    else:  # an unpacked sdist
        shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(
            ".venv", "dist", "build", "__pycache__", "test-artifacts"), dirs_exist_ok=True)
    return target


def has_venv(python: Path) -> bool:
    """Whether python can create a venv with pip (Debian splits this into python3-venv)."""
    return subprocess.run([str(python), "-c", "import ensurepip, venv"],
                          capture_output=True).returncode == 0


def newcomer_env(home: Path, python: Path) -> dict[str, str]:
    """A login shell's environment with `python3` being python: no venv active, own HOME."""
    home.mkdir(parents=True, exist_ok=True)
    # python's own directory first: `python3` is then python itself (a symlink to it elsewhere
    # would become the venv's interpreter, seen through the link)
    bin_dir = python.parent
    env = {name: value for name, value in os.environ.items()
           if name.startswith("PIP_") or name in ("LANG", "LC_ALL", "TMPDIR")}
    # pip's own set-up on this machine (its index, its cache) lives in the real user's home,
    # which the tests' conftest replaced: a newcomer's pip has its own.
    real_home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    if "PIP_CONFIG_FILE" not in env and (real_home / ".config/pip/pip.conf").is_file():
        env["PIP_CONFIG_FILE"] = str(real_home / ".config/pip/pip.conf")
    if "PIP_CACHE_DIR" not in env and (real_home / ".cache/pip").is_dir():
        env["PIP_CACHE_DIR"] = str(real_home / ".cache/pip")
    return {**env, "HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin",
            "JUPYTER_DATA_DIR": str(home / "jupyter-data"),
            "JUPYTER_RUNTIME_DIR": str(home / "jupyter-runtime"),
            "JUPYTER_CONFIG_DIR": str(home / "jupyter-config")}


def run_block(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One block in bash, stopping at its first failing command."""
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=SETUP_TIMEOUT)


def python_for_newcomers() -> Path:
    """Debian's system Python where there is one with venv; otherwise this one's base."""
    if DEBIAN_PYTHON.exists() and has_venv(DEBIAN_PYTHON):
        return DEBIAN_PYTHON
    return Path(sys.base_prefix) / "bin" / "python3"


def test_every_runnable_doc_has_blocks():
    assert len(runnable_blocks(ROOT / "README.md")) == 2
    assert len(runnable_blocks(ROOT / "docs" / "deploy.md")) == 2
    assert len(runnable_blocks(ROOT / "docs" / "secrets.md")) == 1


def test_the_local_secret_recipe_runs_as_written(tmp_path):
    """docs/secrets.md: a secret end to end on this machine, with the installed command (five
    tries without a recipe, #45 item 7). User code holds the placeholder; the server gets the
    value."""
    [recipe] = runnable_blocks(ROOT / "docs" / "secrets.md")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = run_block(recipe, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "Bearer my-local-test-value\n", done.stdout
    assert re.search(r"^user code holds: sk-sandbox-API_KEY-\w+\nthe server answered: ok\n",
                     done.stderr, re.M), done.stderr
    assert "my-local-test-value" not in done.stderr


@pytest.mark.timeout(SETUP_TIMEOUT + 60)
def test_the_readme_setup_and_main_job_on_the_system_python(tmp_path):
    if DEBIAN_PYTHON.exists() and not has_venv(DEBIAN_PYTHON):
        unavailable("Debian's /usr/bin/python3 lacks venv: `apt-get install python3-venv` "
                    "(the README's requirements say so)")
    python = python_for_newcomers()
    setup, lab = runnable_blocks(ROOT / "README.md")
    checkout, env = checkout_copy(tmp_path / "checkout"), newcomer_env(tmp_path / "home", python)
    done = run_block(setup, checkout, env)
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = json.loads((ROOT / "examples" / "summarize.json").read_text())["numbers"]
    result = json.loads(done.stdout)
    assert (result["count"], result["total"]) == (len(numbers), sum(numbers))
    pyvenv = (checkout / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {python.parent}\n" in pyvenv  # the venv was made from that interpreter
    # JupyterLab and `jupyter execute` with the kernel, in the same .venv (#32 item 1)
    done = run_block(lab, checkout, env)
    assert done.returncode == 0, done.stderr[-3000:]
    executed = json.loads((checkout / "examples" / "summarize-executed.ipynb").read_text())
    [shown] = executed["cells"][-1]["outputs"]
    assert shown["data"]["application/json"] == {"count": 5, "total": 14}
    lab_app = run_block(". .venv/bin/activate && jupyter lab --version", checkout, env)
    assert lab_app.returncode == 0, lab_app.stderr[-3000:]


@pytest.mark.timeout(SETUP_TIMEOUT * 2)
def test_deploy_md_builds_a_wheel_and_installs_it_in_a_fresh_environment(tmp_path):
    checkout = checkout_copy(tmp_path / "checkout")
    env = newcomer_env(tmp_path / "home", python_for_newcomers())
    outputs = []
    for block in runnable_blocks(ROOT / "docs" / "deploy.md"):
        done = run_block(block, checkout, env)
        assert done.returncode == 0, (block, done.stderr[-3000:])
        outputs.append(done.stdout)
    [wheel] = (checkout / "dist").glob("sandbox_kernel-*.whl")
    spec = tmp_path / "home" / "singleuser" / "share" / "jupyter" / "kernels" / "sandbox"
    kernel = json.loads((spec / "kernel.json").read_text())
    assert kernel["argv"][0] == str(tmp_path / "home" / "singleuser" / "bin" / "python3")
    assert "--SandboxPolicy.grant_cwd=ro" in kernel["argv"]
    assert "the kernel will start" in outputs[-1]
    assert wheel.name.startswith("sandbox_kernel-")


def pip_installs(doc: Path) -> list[str]:
    """Every `pip install` line in the doc's shell blocks."""
    return [line.strip() for block in SHELL_BLOCK.findall(doc.read_text())
            for line in block.splitlines() if re.search(r"\bpip install\b", line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_doc_installs_this_package_from_an_index(doc):
    for line in pip_installs(doc):
        commands = re.split(r"&&|\|\||;|\|", line.split("#")[0])
        arguments = " ".join(c for c in commands if re.search(r"\bpip install\b", c))
        for word in re.findall(r"['\"]?(sandbox[-_]kernel[^\s'\"]*)", arguments):
            assert "/" in word or word.endswith(".whl"), \
                f"{doc.name}: `{line}` installs {word} from an index, where it is not"


# --- the Dify overlay, merged onto Dify's sandbox service as Compose merges ---------------------

class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's `!reset` tag (the value then replaces, not merges)."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset(
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else None))


class _Reset:
    def __init__(self, value):
        self.value = value


# The fields of Dify's `sandbox` service (docker/docker-compose.yaml) that the overlay meets.
DIFY_SANDBOX = {
    "image": "langgenius/dify-sandbox:0.2.14",
    "restart": "always",
    "environment": {"API_KEY": "${SANDBOX_API_KEY:-dify-sandbox}",
                    "WORKER_TIMEOUT": "${SANDBOX_WORKER_TIMEOUT:-15}",
                    "ENABLE_NETWORK": "${SANDBOX_ENABLE_NETWORK:-true}",
                    "HTTP_PROXY": "${SANDBOX_HTTP_PROXY:-http://ssrf_proxy:3128}",
                    "HTTPS_PROXY": "${SANDBOX_HTTPS_PROXY:-http://ssrf_proxy:3128}",
                    "SANDBOX_PORT": "${SANDBOX_PORT:-8194}"},
    "volumes": ["./volumes/sandbox/dependencies:/dependencies", "./volumes/sandbox/conf:/conf"],
    "healthcheck": {"test": ["CMD", "curl", "-f", "http://localhost:8194/health"]},
    "networks": ["ssrf_proxy_network"],
}


REPLACED = ("command", "entrypoint", "test")  # commands replace, never append (compose-go)


def compose_merge(base, override):
    """Compose's merge: mappings key by key, sequences appended, scalars replaced, !reset."""
    if isinstance(override, _Reset):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        return {key: override[key] if key in REPLACED and key in override
                else compose_merge(base[key], override[key]) if key in base and key in override
                else override.get(key, base.get(key)) for key in {**base, **override}}
    if isinstance(base, list) and isinstance(override, list):
        return base + [item for item in override if item not in base]
    return override


def test_the_dify_overlay_keeps_difys_network_and_proxy_and_replaces_the_rest():
    overlay_file = ROOT / "deploy" / "service" / "dify" / "docker-compose.override.yaml"
    overlay = yaml.load(overlay_file.read_text(), Loader=_ComposeLoader)
    assert set(overlay) == {"services"} and set(overlay["services"]) == {"sandbox"}
    ours = overlay["services"]["sandbox"]
    assert "build" not in ours and "ports" not in ours  # nothing relative to our checkout
    merged = compose_merge(DIFY_SANDBOX, ours)
    assert merged["image"] == "sandbox-kernel-service"
    assert merged["networks"] == ["ssrf_proxy_network"]
    assert merged["environment"]["HTTP_PROXY"] == "${SANDBOX_HTTP_PROXY:-http://ssrf_proxy:3128}"
    assert merged["environment"]["HTTPS_PROXY"] == DIFY_SANDBOX["environment"]["HTTPS_PROXY"]
    assert merged["environment"]["API_KEY"] == "${SANDBOX_API_KEY:-dify-sandbox}"
    assert merged["volumes"] == ["./volumes/sandbox-kernel/state:/var/lib/sandbox-kernel"]
    assert merged["environment"]["SANDBOX_STATE_DIR"] == "/var/lib/sandbox-kernel"
    assert "curl" not in merged["healthcheck"]["test"]  # the image has none
    assert merged["cap_drop"] == ["ALL"] and merged["read_only"] is True
    # Dify's Template nodes import jinja2: in the kernels' runtime of the image
    requirements = (ROOT / "deploy" / "service" / "python-requirements.txt").read_text()
    assert re.search(r"^jinja2\b", requirements, re.M)
    assert "python-requirements.txt" in (ROOT / "deploy" / "service" / "Dockerfile").read_text()
