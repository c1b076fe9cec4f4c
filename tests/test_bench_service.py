"""bench.service and bench.clients: the request they send and the kernelspecs they start
(their timings live in bench/results, never here)."""

import contextlib
import io
import json

from bench import clients, service


def test_the_dify_request_prints_exactly_what_the_check_expects():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(service.dify_wrapped(service.USER_CODE, {}), {})
    assert out.getvalue() == service.EXPECTED_STDOUT
    route = service.dify_route("key")
    body = json.loads(route.body)
    assert body["language"] == "python3" and body["enable_network"] is True
    assert route.check({"code": 0, "data": {"stdout": service.EXPECTED_STDOUT}})
    assert not route.check({"code": 0, "data": {"stdout": "{}"}})
    native = service.native_route("key")
    assert native.check({"result": {"a": 1}, "error": None})
    assert not native.check({"result": None, "error": {"name": "X"}})


def test_the_clients_bench_starts_plain_ipykernel_and_the_fork_served_kernel(tmp_path):
    clients.write_kernelspecs(tmp_path)
    plain = json.loads((tmp_path / "kernels/bench-plain/kernel.json").read_text())
    fork = json.loads((tmp_path / "kernels/bench-fork/kernel.json").read_text())
    assert plain["argv"][1:3] == ["-m", "ipykernel_launcher"]
    assert fork["argv"][1:4] == ["-I", "-m", "sandbox_kernel"]
    assert fork["metadata"]["kernel_provisioner"]["provisioner_name"] == \
        "sandbox-fork-provisioner"


def test_the_service_report_compares_with_dify_sandbox_and_says_what_is_missed():
    def phase(latency, count, cpu):
        return service.Phase([latency] * count, 0, 1.0, cpu, cpu * 2, cpu / 2)

    theirs = service.Totals([phase(0.050, 10, 0.5)], [phase(0.1, 40, 2.0)])
    ours = service.Totals([phase(0.020, 10, 0.3)], [phase(0.1, 60, 2.0)])
    args = type("Args", (), {"rounds": 1, "seq": 10, "clients": 4, "seconds": 1.0,
                             "pool_size": 1, "serve_flag": None})()
    text = service.report(args, {"dify-sandbox": theirs, "ours": ours}, (0, 0), (0.0, 0.0))
    assert "| ours | 0.400x | 1.500x |" in text and "| yes |" in text
