"""The docs' commands work as a newcomer types them.

Every shell or Python block of README.md and of the pages that start from zero (PAGES) is marked:
`<!-- runnable ... -->` blocks are run as written, `<!-- not run: WHY -->` ones say why and where
they are run instead (Docker's in tests/test_container.py, say). Runnable blocks run in a copy of
the checkout with a fresh HOME: the README's first, on Debian's own /usr/bin/python3 where it
exists (the interpreter a new user of a Debian or Ubuntu machine has), then each page's in order
in the same copy (the `.venv` the README made, as a reader who followed it has), each page as one
terminal session: what a block exports reaches the page's next blocks, a Python block runs as a
file with the session's `python3`, and whatever a page started in the background (a service, a
gateway) is stopped after it. A port a page names (8194, 8888) is swapped for a free one, so
that the run meets no other process on this machine. docs/deploy.md's blocks run in a copy of
their own; docs/secrets.md's with this checkout's installed command, in a folder of its own.
Every `sandbox-kernel` command in any doc, run or not, is parsed by the CLI's own
parser, so none names a flag or subcommand that does not exist; every flag of the policy and of
the service is in its page's table. Every `pip install` of this package in any doc installs it
from the checkout or a wheel built there: it is on no package index.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sandbox_kernel import cli
from sandbox_kernel.service import config as service_config

from .ci_tools import unavailable

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "deploy").rglob("*.md"))]
# The pages each kind of user starts from zero on: every block marked, the runnable ones run.
PAGES = ["notebooks.md", "python.md", "policy.md", "service.md", "dify.md", "deploy.md",
         "benchmarks.md", "agents.md"]
# Run after the README's blocks, in its checkout copy, in this order (deploy.md has its own).
RUN_AFTER_README = ["notebooks.md", "python.md", "policy.md", "service.md", "dify.md"]
MARKED = re.compile(r"<!-- (runnable|not run)([^>]*)-->\n[ \t]*```(bash|sh|python)\n(.*?)```", re.S)
BLOCK = re.compile(r"^[ \t]*```(bash|sh|console|python)\n", re.M)
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)
PORTS = ("8194", "8888")  # the ports pages start servers on: swapped for free ones when run
DEBIAN_PYTHON = Path("/usr/bin/python3")
SETUP_TIMEOUT = 600  # seconds: a fresh venv, its packages from pip's cache, then the job


def runnable_blocks(doc: Path) -> list[tuple[str, str]]:
    """The doc's blocks marked runnable, in order: (language, text), indentation removed."""
    return [(language, _dedent(text)) for kind, _, language, text in MARKED.findall(doc.read_text())
            if kind == "runnable"]


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines) + "\n"


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Session:
    """One page's blocks as one terminal session, in cwd: exports carry over from block to
    block, and every process a block left running is stopped by close()."""

    def __init__(self, cwd: Path, env: dict[str, str], scratch: Path,
                 carry_exports: bool = True) -> None:
        self.cwd, self.env, self.scratch = cwd, env, scratch
        self.carry_exports = carry_exports
        scratch.mkdir(parents=True, exist_ok=True)
        self.exports = scratch / "exports.sh"
        self.ports = {port: str(_free_port()) for port in PORTS}
        self.groups: list[int] = []
        self.count = 0

    def run(self, language: str, block: str) -> subprocess.CompletedProcess:
        """The block in bash (stopping at its first failing command), or a Python block as a
        file run by the session's python3; its output as a CompletedProcess."""
        for port, free in self.ports.items():
            block = re.sub(rf"\b{port}\b", free, block)
        self.count += 1
        if language == "python":
            script = self.scratch / f"block-{self.count}.py"
            script.write_text(block)
            block = f"python3 {shlex.quote(str(script))}\n"
        source = f"[ ! -f {shlex.quote(str(self.exports))} ] || . {shlex.quote(str(self.exports))}"
        keep = (f"export -p | grep -Ev '^declare -x (PWD|OLDPWD|SHLVL)=' > "
                f"{shlex.quote(str(self.exports))}") if self.carry_exports else ""
        out = self.scratch / f"block-{self.count}.out"
        err = self.scratch / f"block-{self.count}.err"
        # Files, not pipes: a server the block leaves running keeps its copy of them open.
        with out.open("w") as stdout, err.open("w") as stderr:
            process = subprocess.Popen(["bash", "-euo", "pipefail", "-c",
                                        f"{source}\n{block}\n{keep}\n"],
                                       cwd=self.cwd, env=self.env, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
            self.groups.append(process.pid)
            try:
                returncode = process.wait(timeout=SETUP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.close()
                returncode = process.wait()
        return subprocess.CompletedProcess(block, returncode, out.read_text(), err.read_text())

    def close(self) -> None:
        """Stop what the blocks started (SIGTERM, then SIGKILL after 10 s)."""
        for sig, pause in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
            alive = []
            for group in self.groups:
                try:
                    os.killpg(group, sig)
                    alive.append(group)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + pause
            while alive and time.monotonic() < deadline:
                alive = [group for group in alive if _group_alive(group)]
                time.sleep(0.2)
        self.groups.clear()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def python_for_newcomers() -> Path:
    """Debian's system Python where there is one with venv; otherwise this one's base."""
    if DEBIAN_PYTHON.exists() and has_venv(DEBIAN_PYTHON):
        return DEBIAN_PYTHON
    return Path(sys.base_prefix) / "bin" / "python3"


def test_every_runnable_doc_has_blocks():
    assert len(runnable_blocks(ROOT / "README.md")) == 2
    assert len(runnable_blocks(ROOT / "docs" / "deploy.md")) == 2
    assert len(runnable_blocks(ROOT / "docs" / "secrets.md")) == 1
    # one venv per framework's extra: tests/test_frameworks.py runs these
    assert len(runnable_blocks(ROOT / "docs" / "agents.md")) == 8
    for page in RUN_AFTER_README:
        assert runnable_blocks(ROOT / "docs" / page), page


def run_block(block: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One block in bash, stopping at its first failing command."""
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=SETUP_TIMEOUT)


def test_the_local_secret_recipe_runs_as_written(tmp_path):
    """docs/secrets.md: a secret end to end on this machine, with the installed command (five
    tries without a recipe, #45 item 7). User code holds the placeholder; the server gets the
    value."""
    [(_, recipe)] = runnable_blocks(ROOT / "docs" / "secrets.md")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = run_block(recipe, tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "Bearer my-local-test-value\n", done.stdout
    assert re.search(r"^user code holds: sk-sandbox-API_KEY-\w+\nthe server answered: ok\n",
                     done.stderr, re.M), done.stderr
    assert "my-local-test-value" not in done.stderr


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_every_block_is_run_or_says_why_not(page):
    doc = ROOT / page if page == "README.md" else ROOT / "docs" / page
    text = doc.read_text()
    marked = {match.start(3) for match in MARKED.finditer(text)}
    for block in BLOCK.finditer(text):
        line = text.count("\n", 0, block.start()) + 1
        assert block.start(1) in marked, \
            f"{page}:{line}: a block without `<!-- runnable -->` or `<!-- not run: why -->`"
    for kind, why, _, _ in MARKED.findall(text):
        assert kind == "runnable" or why.strip(": "), f"{page}: `not run` says why"


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    """The README's set-up run in a copy of the checkout: (checkout, env, outputs)."""
    if DEBIAN_PYTHON.exists() and not has_venv(DEBIAN_PYTHON):
        unavailable("Debian's /usr/bin/python3 lacks venv: `apt-get install python3-venv` "
                    "(the README's requirements say so)")
    python = python_for_newcomers()
    tmp = tmp_path_factory.mktemp("newcomer")
    checkout, env = checkout_copy(tmp / "checkout"), newcomer_env(tmp / "home", python)
    session = Session(checkout, env, tmp / "readme")
    outputs = []
    try:
        for language, block in runnable_blocks(ROOT / "README.md"):
            done = session.run(language, block)
            outputs.append(done)
            if done.returncode:
                break
    finally:
        session.close()
    return checkout, env, python, outputs


@pytest.mark.timeout(SETUP_TIMEOUT + 60)
def test_the_readme_setup_and_main_job_on_the_system_python(newcomer):
    checkout, env, python, (done, *lab) = newcomer
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = json.loads((ROOT / "examples" / "summarize.json").read_text())["numbers"]
    result = json.loads(done.stdout)
    assert (result["count"], result["total"]) == (len(numbers), sum(numbers))
    pyvenv = (checkout / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {python.parent}\n" in pyvenv  # the venv was made from that interpreter
    # JupyterLab and `jupyter execute` with the kernel, in the same .venv (#32 item 1)
    [done] = lab
    assert done.returncode == 0, done.stderr[-3000:]
    executed = json.loads((checkout / "examples" / "summarize-executed.ipynb").read_text())
    [shown] = executed["cells"][-1]["outputs"]
    assert shown["data"]["application/json"] == {"count": 5, "total": 14}
    lab_app = subprocess.run(["bash", "-c", ". .venv/bin/activate && jupyter lab --version"],
                             cwd=checkout, env=env, capture_output=True, text=True, timeout=120)
    assert lab_app.returncode == 0, lab_app.stderr[-3000:]


# What each page's run must have shown, beyond every block's exit status 0.
EXPECTED = {
    "notebooks.md": ["42", "numpy"],
    "python.md": ["{'y': 42}", "{'double': 2}", "['statistics', 'scores']", "[1, 2]", "{'x': 1}",
                  "display-1.png", '"total": 6'],
    "policy.md": [],
    "service.md": ['"stdout":"42\\n"', '"result":{"y":42}', "event: done", '8\\n'],
    "dify.md": ['"stdout":"42\\n"'],
}


@pytest.mark.timeout(SETUP_TIMEOUT * 2)
@pytest.mark.parametrize("page", RUN_AFTER_README)
def test_the_page_runs_as_written_after_the_readme(page, newcomer, tmp_path):
    checkout, env, _, outputs = newcomer
    if any(done.returncode for done in outputs):
        pytest.fail("the README's set-up failed: see its test", pytrace=False)
    session = Session(checkout, env, tmp_path)
    shown = []
    try:
        for language, block in runnable_blocks(ROOT / "docs" / page):
            done = session.run(language, block)
            assert done.returncode == 0, (block, done.stdout[-2000:], done.stderr[-3000:])
            shown.append(done.stdout)
    finally:
        session.close()
    everything = "\n".join(shown)
    for expected in EXPECTED[page]:
        assert expected in everything, (expected, everything[-3000:])


@pytest.mark.timeout(SETUP_TIMEOUT * 2)
def test_deploy_md_builds_a_wheel_and_installs_it_in_a_fresh_environment(tmp_path):
    checkout = checkout_copy(tmp_path / "checkout")
    env = newcomer_env(tmp_path / "home", python_for_newcomers())
    # Its blocks are on two machines (where the wheel is built, where it is installed): no
    # block's exports reach the next.
    session = Session(checkout, env, tmp_path / "session", carry_exports=False)
    outputs = []
    try:
        for language, block in runnable_blocks(ROOT / "docs" / "deploy.md"):
            done = session.run(language, block)
            assert done.returncode == 0, (block, done.stderr[-3000:])
            outputs.append(done.stdout)
    finally:
        session.close()
    [wheel] = (checkout / "dist").glob("sandbox_kernel-*.whl")
    spec = tmp_path / "home" / "singleuser" / "share" / "jupyter" / "kernels" / "sandbox"
    kernel = json.loads((spec / "kernel.json").read_text())
    assert kernel["argv"][0] == str(tmp_path / "home" / "singleuser" / "bin" / "python3")
    assert "--SandboxPolicy.grant_cwd=ro" in kernel["argv"]
    assert "the kernel will start" in outputs[-1]
    assert wheel.name.startswith("sandbox_kernel-")


# --- commands and flags: every one a doc shows exists -------------------------------------------

def sandbox_kernel_commands(doc: Path) -> list[list[str]]:
    """Every `sandbox-kernel ...` (or `python -m sandbox_kernel ...`) command in the doc's shell
    blocks, as its arguments: up to the first shell operator, redirection or comment."""
    found = []
    for block in SHELL_BLOCK.findall(doc.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(?<=\s)\d+(?=>)", "", line)  # 2>&1: the descriptor's number
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            try:
                words, command = list(lexer), None
            except ValueError:  # a quoted string going on to the next line: Python, JSON
                continue
            for at, word in enumerate(words):
                if command is not None and set(word) <= set("|&;<>()"):
                    found.append(command)
                    command = None
                elif command is not None:
                    command.append(word)
                elif word.rsplit("/", 1)[-1] == "sandbox-kernel" or (
                        word == "sandbox_kernel" and words[at - 1:at] == ["-m"]):
                    command = []
            if command is not None:
                found.append(command)
    return [words for words in found if words and words[0] != "eg-launch"]  # EG parses its own


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_sandbox_kernel_command_in_a_doc_parses(doc, capsys):
    for words in sandbox_kernel_commands(doc):
        try:
            cli.parser().parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{doc.name}: `sandbox-kernel {shlex.join(words)}`: "
                        f"{capsys.readouterr().err.strip() or exc}", pytrace=False)


def test_every_policy_flag_is_a_row_of_policy_md():
    table = (ROOT / "docs" / "policy.md").read_text()
    flags = re.findall(r'flag="([a-z-]+)"', (ROOT / "sandbox_kernel" / "policy.py").read_text())
    assert len(flags) > 20
    missing = [flag for flag in flags if not re.search(rf"^\| `--{flag}\b", table, re.M)
               and f"(`--{flag}` is" not in table]
    assert not missing, f"docs/policy.md's table lacks {missing}"


def test_every_service_setting_is_in_service_md_with_its_variable():
    page = (ROOT / "docs" / "service.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    missing = []
    for trait in service_config.ServiceConfig.class_traits(config=True).values():
        flag, env = trait.metadata.get("flag"), trait.metadata.get("env")
        row = next((line for line in rows if flag and f"`--{flag}`" in line), None)
        if flag and (row is None or (env and f"`{env}`" not in row)):
            missing.append(f"--{flag} ({env})")
    assert not missing, f"docs/service.md's settings table lacks {missing}"


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


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", markdown, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_to_a_file_or_heading_of_the_checkout_resolves(doc):
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        assert target.exists(), f"{doc.name}: {link}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target.read_text()), f"{doc.name}: {link}: no such heading"
