"""The EG kernelspecs `install --enterprise-gateway` writes, and the pod they describe.

The pod template is rendered the way EG's launch_kubernetes.py renders it (Jinja with
trim_blocks/lstrip_blocks and a `yaml_safe` filter; every KERNEL_* variable as kernel_*), then
checked against the Kubernetes schema through the `kubernetes` client's models: the document
must deserialize into V1Pod / V1NetworkPolicy and serialize back to exactly itself, so a
misspelt or misplaced field (which the models would drop) fails the test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

jinja2 = pytest.importorskip("jinja2")
yaml = pytest.importorskip("yaml")
kubernetes = pytest.importorskip("kubernetes")

# What a client may send in the create request (KERNEL_* reach the template), some of it hostile.
CLIENT_ENV = {
    "KERNEL_ID": "0b4a1c52-7d1e-4c2f-9d7a-2f4f1e0c9a11", "KERNEL_USERNAME": "alice",
    "KERNEL_NAMESPACE": "enterprise-gateway", "KERNEL_POD_NAME": "alice-0b4a1c52",
    "KERNEL_SERVICE_ACCOUNT_NAME": "default", "KERNEL_MEMORY_LIMIT": "3Gi",
    "KERNEL_IMAGE": "attacker/unsandboxed:latest", "KERNEL_UID": "0", "KERNEL_GID": "0",
    "KERNEL_VOLUMES": "[{name: host, hostPath: {path: /}}]",
    "KERNEL_VOLUME_MOUNTS": "[{name: host, mountPath: /host}]",
    "KERNEL_WORKING_DIR": "/host",
}


def yaml_safe(value):
    """The escaping EG's yaml_safe filter performs (PyYAML's serializer)."""
    if isinstance(value, str):
        return yaml.dump(value, default_style='"', width=10000).strip()
    return yaml.dump(value, default_flow_style=True, width=10000).replace("\n...", "").strip()


def render_like_eg(scripts: Path, env: dict[str, str]) -> list[dict]:
    keywords = {name.lower(): (yaml.safe_load(value) if name in ("KERNEL_VOLUMES",
                                                                 "KERNEL_VOLUME_MOUNTS")
                               else value) for name, value in env.items()}
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(scripts)),
                                     trim_blocks=True, lstrip_blocks=True)
    environment.filters["yaml_safe"] = yaml_safe
    text = environment.get_template("kernel-pod.yaml.j2").render(**keywords)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def round_trip(document: dict, model: str) -> None:
    api = kubernetes.client.ApiClient()
    parsed = api._ApiClient__deserialize(document, model)
    assert api.sanitize_for_serialization(parsed) == document


@pytest.fixture(scope="module")
def k8s_spec(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("eg-k8s")
    run = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel", "install", "--prefix", str(prefix),
         "--name", "sandbox_kubernetes", "--enterprise-gateway", "kubernetes",
         "--image", "registry.example/sandbox-kernel:1.0", "--timeout", "30",
         "--k8s-memory-limit", "1Gi", "--k8s-scratch-size", "512Mi",
         "--eg-port-range", "40000..41000"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return prefix / "share" / "jupyter" / "kernels" / "sandbox_kubernetes"


def test_kubernetes_kernel_json_runs_egs_launcher_with_the_image(k8s_spec):
    spec = json.loads((k8s_spec / "kernel.json").read_text())
    proxy = spec["metadata"]["process_proxy"]
    assert proxy["class_name"] == \
        "enterprise_gateway.services.processproxies.k8s.KubernetesProcessProxy"
    assert proxy["config"]["image_name"] == "registry.example/sandbox-kernel:1.0"
    assert spec["argv"][1] == f"{k8s_spec}/scripts/launch_kubernetes.py"
    assert "{public_key}" in spec["argv"] and "{response_address}" in spec["argv"]


def test_rendered_pod_is_a_valid_hardened_pod(k8s_spec):
    (pod,) = render_like_eg(k8s_spec / "scripts", CLIENT_ENV)
    assert pod["kind"] == "Pod"
    round_trip(pod, "V1Pod")
    spec = pod["spec"]
    (container,) = spec["containers"]
    # Fixed at install time, whatever the client's KERNEL_* variables say.
    assert container["image"] == "registry.example/sandbox-kernel:1.0"
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["runAsNonRoot"]
    assert [v["name"] for v in spec["volumes"]] == ["scratch"]
    assert "workingDir" not in container and "serviceAccountName" not in spec
    assert spec["automountServiceAccountToken"] is False
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    # deploy/service/seccomp.json on the node: what network kernels need (test_container.py).
    assert context["seccompProfile"] == {"type": "Localhost",
                                         "localhostProfile": "profiles/sandbox-kernel.json"}
    assert container["command"] == ["python", "-I", "-m", "sandbox_kernel", "eg-launch"]
    # The policy, and how its operator changes it (a refusal's advice names this install).
    prefix = k8s_spec.parent.parent.parent.parent
    assert container["args"] == [
        f"--SandboxPolicy.changed_with=sandbox-kernel install --prefix {prefix} "
        "--name sandbox_kubernetes", "--SandboxPolicy.timeout=30.0"]
    limits = container["resources"]["limits"]
    assert limits == {"cpu": "1", "memory": "3Gi", "ephemeral-storage": "2Gi"}  # memory: client
    assert spec["volumes"][0]["emptyDir"] == {"sizeLimit": "512Mi"}
    assert container["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"}]


def test_client_values_cannot_inject_yaml(k8s_spec):
    env = {**CLIENT_ENV, "KERNEL_MEMORY_LIMIT": '1Gi"\n    privileged: true\n#'}
    (pod,) = render_like_eg(k8s_spec / "scripts", env)
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["privileged"] is False
    assert container["resources"]["limits"]["memory"] == env["KERNEL_MEMORY_LIMIT"]


def test_network_policy_is_valid_and_narrow(k8s_spec):
    policy = yaml.safe_load((k8s_spec / "kernel-networkpolicy.yaml").read_text())
    round_trip(policy, "V1NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"sandbox-kernel": "true"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = spec["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 40000, "endPort": 41000}]
    (egress,) = spec["egress"]
    assert egress["ports"] == [{"protocol": "TCP", "port": 8877}]
    for rule in (ingress["from"], egress["to"]):
        assert rule[0]["podSelector"] == {"matchLabels": {"gateway-selector": "enterprise-gateway"}}


def test_docker_and_distributed_kernelspecs(tmp_path):
    from sandbox_kernel.install import install
    from sandbox_kernel.policy import SandboxPolicy

    policy = SandboxPolicy(allow_network=True)
    docker = Path(install(policy, name="sb_docker", prefix=str(tmp_path),
                          enterprise_gateway="docker"))
    spec = json.loads((docker / "kernel.json").read_text())
    assert spec["metadata"]["process_proxy"]["class_name"].endswith("DockerSwarmProcessProxy")
    assert spec["argv"][1].endswith("/scripts/launch_docker.py")
    assert spec["env"] == {"SANDBOX_KERNEL_EG_POLICY": "--SandboxPolicy.allow_network=True"}
    distributed = Path(install(policy, name="sb_dist", prefix=str(tmp_path),
                               enterprise_gateway="distributed"))
    spec = json.loads((distributed / "kernel.json").read_text())
    assert spec["argv"][:5] == [sys.executable, "-I", "-m", "sandbox_kernel", "eg-launch"]
    assert spec["argv"][-1] == "--SandboxPolicy.allow_network=True"
    assert not (distributed / "scripts").exists()


def test_eg_policy_variable_reaches_the_launcher():
    from sandbox_kernel.launch.eg import parse_arguments

    request = parse_arguments([], {"KERNEL_ID": "k", "RESPONSE_ADDRESS": "10.0.0.1:8877",
                                   "PUBLIC_KEY": "AAAA", "PORT_RANGE": "40000..40999",
                                   "SANDBOX_KERNEL_EG_POLICY": "--SandboxPolicy.timeout=5"})
    assert request.response_address == ("10.0.0.1", 8877)
    assert request.port_range == (40000, 40999)
    assert request.policy_argv == ["--SandboxPolicy.timeout=5"]


def test_bad_seccomp_profile_is_refused(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "sandbox_kernel", "install", "--prefix", str(tmp_path),
         "--enterprise-gateway", "kubernetes", "--k8s-seccomp-profile", "Unconfined"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "RuntimeDefault" in run.stderr


def test_check_pod_manifest_is_valid_and_confined_like_a_kernel(k8s_spec):
    root = Path(__file__).resolve().parent.parent / "deploy" / "enterprise-gateway"
    check = yaml.safe_load((root / "check-pod.yaml").read_text())
    round_trip(check, "V1Pod")
    (pod,) = render_like_eg(k8s_spec / "scripts", CLIENT_ENV)
    for key in ("securityContext", "automountServiceAccountToken", "enableServiceLinks"):
        assert check["spec"][key] == pod["spec"][key]
    assert check["spec"]["containers"][0]["securityContext"] == \
        pod["spec"]["containers"][0]["securityContext"]
    assert check["spec"]["containers"][0]["command"][-3:] == ["check", "--network", "on"]


def test_shipped_seccomp_profile_is_the_generated_one(k8s_spec):
    from sandbox_kernel.confine import seccomp
    from sandbox_kernel.launch.eg_kernelspec import pod_seccomp_profile

    shipped = Path(__file__).resolve().parent.parent / "deploy" / "enterprise-gateway"
    profile = json.loads((shipped / "seccomp-profile.json").read_text())
    assert profile == pod_seccomp_profile()
    assert json.loads((k8s_spec / "seccomp-profile.json").read_text()) == profile
    allowed = set(profile["syscalls"][0]["names"])
    # What the kernel needs to confine itself, and nothing that breaks out of a container.
    assert {"seccomp", "prctl", "landlock_create_ruleset", "landlock_add_rule",
            "landlock_restrict_self"} <= allowed
    assert not {"mount", "unshare", "setns", "bpf", "ptrace", "keyctl", "io_uring_setup",
                "open_by_handle_at", "init_module", "kexec_load"} & allowed
    assert set(seccomp.ALLOWED) <= allowed


def test_kernel_is_execd_with_none_of_egs_environment():
    from sandbox_kernel.launch.eg import kernel_environment

    eg_env = {"PATH": "/opt/eg/bin:/usr/bin", "LANG": "de_DE.UTF-8", "EG_AUTH_TOKEN": "t",
              "PUBLIC_KEY": "k", "LD_PRELOAD": "/x.so", "PYTHONPATH": "/y", "DATA_URL": "u"}
    assert kernel_environment([], eg_env) == {"PATH": "/usr/local/bin:/usr/bin:/bin",
                                              "LANG": "de_DE.UTF-8"}
    granted = kernel_environment(["--SandboxPolicy.pass_env=DATA_URL"], eg_env)
    assert granted["DATA_URL"] == "u" and "EG_AUTH_TOKEN" not in granted
    assert "DATA_URL" not in kernel_environment(["--SandboxPolicy.pass_env"], eg_env)


# Runs EG's own launch_kubernetes.py as EG runs it, with --pod-template (render, write the pod,
# create nothing), and keeps what its Jinja rendered: the text EG would send to the API.
EG_RENDER = """
import jinja2, runpy, sys
rendered = []
render = jinja2.Template.render
def keep(self, *args, **kwargs):
    rendered.append(render(self, *args, **kwargs))
    return rendered[-1]
jinja2.Template.render = keep
script, keep_in = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    open(keep_in, "w").write("".join(rendered))
"""
KUBECONFIG = {"apiVersion": "v1", "kind": "Config", "current-context": "none",
              "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
              "users": [{"name": "none", "user": {"token": "none"}}],
              "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}]}
# Each a value a client may put in the create request's env, and what each tries.
HOSTILE_ENV = {
    "KERNEL_POD_NAME": "{{ 7 * 7 }}-{{ ''.__class__.__mro__[1].__subclasses__() }}",  # #1412
    "KERNEL_MEMORY_LIMIT": '1Gi"\n    privileged: true\n#',  # GHSA-cfw7-6c5v-2wjq
    "KERNEL_CPUS": "1\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: planted}\n",
    "KERNEL_CPUS_LIMIT": "{% for x in range(10) %}{{ x }}{% endfor %}",
    "KERNEL_MEMORY": "256Mi\n      hostPath: {path: /}",
    "KERNEL_EPHEMERAL_STORAGE": "1Gi\u2028privileged: true\x85hostPID: true",  # YAML's breaks
    "KERNEL_EPHEMERAL_STORAGE_LIMIT": "1Gi' }, hostNetwork: true, x: { '",
}


@pytest.fixture(scope="session")
def eg_kubernetes_launcher(eg_python):
    from tests import eg_venv
    from tests.ci_tools import unavailable

    try:
        return eg_venv.kubernetes_launcher()
    except (RuntimeError, OSError, subprocess.SubprocessError, tarfile.TarError) as exc:
        unavailable(f"Enterprise Gateway's launch_kubernetes.py is not at hand: {exc}")


def render_with_eg(eg_python, launcher, k8s_spec, where, env, kernel_id):
    """The documents EG 3.3.0's own launch_kubernetes.py renders from the installed template
    (as EG runs it: from the kernelspec's scripts/), and the pod it would create."""
    scripts = where / "scripts"
    shutil.copytree(k8s_spec / "scripts", scripts)
    shutil.copy(launcher, scripts / "launch_kubernetes.py")
    (where / "kubeconfig").write_text(json.dumps(KUBECONFIG))
    argv = [str(scripts / "launch_kubernetes.py"), str(where / "rendered.yaml"),
            "--RemoteProcessProxy.kernel-id", kernel_id,
            "--RemoteProcessProxy.port-range", "40000..41000",
            "--RemoteProcessProxy.response-address", "127.0.0.1:8877",
            "--RemoteProcessProxy.public-key", "AAAA",
            "--RemoteProcessProxy.spark-context-initialization-mode", "none",
            "--pod-template", str(where / "pod.yaml")]
    run = subprocess.run([str(eg_python), "-I", "-c", EG_RENDER, *argv], capture_output=True,
                         text=True, timeout=120, cwd=where,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(where),
                              "KUBECONFIG": str(where / "kubeconfig"), **env})
    assert run.returncode == 0, run.stderr
    rendered = [doc for doc in yaml.safe_load_all((where / "rendered.yaml").read_text()) if doc]
    return rendered, yaml.safe_load((where / "pod.yaml").read_text())


@pytest.mark.parametrize("kernel_id", ["0b4a1c52-7d1e-4c2f-9d7a-2f4f1e0c9a11",
                                       'k"\nspec: {hostNetwork: true}\n#{{ 6 * 7 }}'])
def test_egs_own_launcher_renders_hostile_values_as_plain_data(
        eg_python, eg_kubernetes_launcher, k8s_spec, tmp_path, kernel_id):
    env = {**CLIENT_ENV, **HOSTILE_ENV}
    rendered, created = render_with_eg(eg_python, eg_kubernetes_launcher, k8s_spec, tmp_path,
                                       env, kernel_id)
    (pod,) = rendered  # one document: no Secret, no second Pod
    assert pod["kind"] == "Pod"
    round_trip(pod, "V1Pod")
    assert pod["metadata"]["name"] == env["KERNEL_POD_NAME"]  # not evaluated: no 49
    assert pod["metadata"]["labels"]["kernel_id"] == kernel_id
    assert pod["metadata"]["namespace"] == "enterprise-gateway"
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {
        "requests": {"cpu": env["KERNEL_CPUS"], "memory": env["KERNEL_MEMORY"],
                     "ephemeral-storage": env["KERNEL_EPHEMERAL_STORAGE"]},
        "limits": {"cpu": env["KERNEL_CPUS_LIMIT"], "memory": env["KERNEL_MEMORY_LIMIT"],
                   "ephemeral-storage": env["KERNEL_EPHEMERAL_STORAGE_LIMIT"]}}
    # What decides the confinement is the install's, whatever the client sent.
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert pod["spec"]["securityContext"]["runAsGroup"] == 1000
    assert container["image"] == "registry.example/sandbox-kernel:1.0"
    assert container["securityContext"]["privileged"] is False
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["scratch"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert pod["spec"][key] is False
    # EG adds its environment to the pod it creates: there, too, only as values.
    assert {k: v for k, v in created.items() if k != "spec"} == \
        {k: v for k, v in pod.items() if k != "spec"}
    passed = {item["name"]: item["value"] for item in created["spec"]["containers"][0]["env"]}
    assert passed["KERNEL_POD_NAME"] == env["KERNEL_POD_NAME"]
    assert passed["KERNEL_ID"] == kernel_id


@pytest.mark.parametrize("uid, refusal", [
    ("0", "--k8s-uid 0: the kernel pod runs as this uid and gid, which must be from 1 to "
          "2147483647, never root's 0 (EG and the pod's runAsNonRoot refuse it); the image's "
          "user is 1000"),
    ("-1", "--k8s-uid -1: the kernel pod runs as this uid and gid, which must be from 1 to "
           "2147483647, never root's 0 (EG and the pod's runAsNonRoot refuse it); the image's "
           "user is 1000"),
    ("2147483648", "--k8s-uid 2147483648: the kernel pod runs as this uid and gid, which must "
                   "be from 1 to 2147483647, never root's 0 (EG and the pod's runAsNonRoot "
                   "refuse it); the image's user is 1000"),
    ("root", "--k8s-uid 'root': expected a whole number"),
    ("1.5", "--k8s-uid '1.5': expected a whole number"),
])
def test_install_refuses_a_root_or_malformed_pod_uid(tmp_path, capsys, uid, refusal):
    from sandbox_kernel import cli

    assert cli.main(["install", "--prefix", str(tmp_path), "--name", "k8s",
                     "--enterprise-gateway", "kubernetes", f"--k8s-uid={uid}"]) == 2
    assert capsys.readouterr().err == f"sandbox-kernel install: {refusal}\n"
    assert not (tmp_path / "share").exists()


def test_install_api_refuses_uid_0_too():
    from traitlets import TraitError

    from sandbox_kernel.launch.eg_kernelspec import EnterpriseGatewaySpec

    with pytest.raises(TraitError, match=r"^--k8s-uid 0: "):
        EnterpriseGatewaySpec(uid=0)
    assert EnterpriseGatewaySpec(uid=1).uid == 1
