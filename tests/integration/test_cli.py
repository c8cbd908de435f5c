"""The `splitserve` command as a user runs it."""

import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.integration import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def splitserve(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "splitserve", *args], capture_output=True,
                          text=True, timeout=timeout)


def cleanup_lines(output: str) -> list[str]:
    """The lines of a stop's steps. After a failed start they hid its cause: the operator read
    'closing the link', 'stopping the data plane', ... first and the error last."""
    steps = ("stopping the", "closing the link", "exited on SIGTERM")
    return [line for line in output.splitlines() if any(step in line for step in steps)]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    s = harness.serve(checkpoints["untied"], tmp_path_factory.mktemp("cli"), "--num-kv-blocks", "64")
    yield s
    s.stop()


def test_serve_logs_one_line_for_its_front_end_serving(server):
    """The front-end said it serves, then the engine said it again on hearing from it ("front-end
    serving gRPC on HOST:PORT", "a gRPC front-end serves on port PORT")."""
    lines = [line for line in server.log().splitlines()
             if "splitserve.frontend" in line and str(server.port) in line]
    assert len(lines) == 1, lines


def test_generate_streams_the_completion(server):
    result = splitserve("generate", "--address", server.address, "--max-tokens", "8",
                        "--temperature", "0", "--ignore-eos", "The quick brown fox")
    assert result.returncode == 0, result.stderr
    expected = server.client.generate("The quick brown fox", max_tokens=8, temperature=0,
                                      ignore_eos=True).text
    assert result.stdout == expected + "\n"
    assert "[8 tokens" in result.stderr and "finish reason: length]" in result.stderr


@pytest.mark.parametrize("how", ["ctrl-c", "closed-pipe"])
def test_generate_stopped_by_its_user_ends_in_one_line(server, how):
    """Ctrl-C, or `| head`, mid-stream: the server aborts the request, and the client says so
    without a traceback (it printed KeyboardInterrupt's or BrokenPipeError's)."""
    client = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "generate", "--address", server.address,
         "--max-tokens", "400", "--ignore-eos", "hi"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client.stdout.read(1)  # streaming
    if how == "ctrl-c":
        client.send_signal(signal.SIGINT)
    else:
        client.stdout.close()
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == (130 if how == "ctrl-c" else 1), stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] in (
        "splitserve: interrupted", "splitserve: output closed"), stderr
    assert server.wait_idle()


def test_generate_reports_invalid_arguments(server):
    result = splitserve("generate", "--address", server.address, "--top-p", "2", "hi")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in result.stderr


def test_health_exit_codes(server, tmp_path):
    assert splitserve("health", "--address", server.address).returncode == 0
    for service in ("liveness", "splitserve.v1.Generation"):
        assert splitserve("health", "--address", server.address, "--service", service).returncode == 0
    # why a check failed: no server there, or no such service (both were "NOT_SERVING")
    dead = splitserve("health", "--address", f"127.0.0.1:{harness.free_port()}", "--timeout", "1")
    assert dead.returncode == 1 and dead.stdout.startswith("UNAVAILABLE: "), dead.stdout
    unknown = splitserve("health", "--address", server.address, "--service", "bogus")
    assert unknown.returncode == 1 and unknown.stdout == "NOT_FOUND: no such service 'bogus'\n", \
        unknown.stdout
    beat = tmp_path / "alive"
    missing = splitserve("health", "--file", str(beat))
    assert missing.returncode == 1 and missing.stdout == f"{beat}: missing\n", missing.stdout
    beat.touch()
    assert splitserve("health", "--file", str(beat), "--max-age", "30").returncode == 0


def test_dataplane_touches_its_liveness_file(checkpoints, tmp_path):
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    beat = tmp_path / "alive"
    process = harness.dataplane(checkpoints["untied"], tmp_path, link, "--liveness-file", str(beat))
    try:
        deadline = time.monotonic() + 60
        while not beat.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        first = beat.stat().st_mtime
        while beat.stat().st_mtime == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert beat.stat().st_mtime > first, "the loop touched the file only once"
    finally:
        process.stop()


def test_serve_with_invalid_flags_exits_at_once_with_the_reason(checkpoints):
    """Flags that contradict each other end `serve` before it starts anything (it used to spawn
    the data plane first and hang on the way out)."""
    result = splitserve("serve", "--model", str(checkpoints["untied"]), "--port", "0",
                        "--tls-cert", "cert.pem", timeout=60)
    assert result.returncode != 0
    assert "--tls-cert and --tls-key go together" in result.stderr


def test_half_a_curve_key_pair_is_a_usage_error(tmp_path):
    result = splitserve("controlplane", "--model", str(tmp_path), "--dataplane-address",
                        "tcp://127.0.0.1:5555", "--link-secret-key", str(tmp_path / "k"))
    assert result.returncode == 2, result.stderr
    assert "CURVE needs both --link-secret-key and --link-authorized-keys" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["serve", "--tp", "0"], "argument --tp: must be >= 1, not 0"),
    (["serve", "--port", "70000"], "argument --port: must be >= 0 and <= 65535, not 70000"),
    (["serve", "--gpu-memory-utilization", "1.5"], "must be > 0 and <= 1, not 1.5"),
    (["serve", "--max-model-len", "0"], "argument --max-model-len: must be >= 1, not 0"),
    (["dataplane", "--model", "m", "--controlplane-address", "127.0.0.1:5555"],
     "argument --controlplane-address: not a ZeroMQ address"),
    (["generate", "--seed", "-1", "hi"], "argument --seed: must be >= 0"),
    (["serve", "--log-level", "verbose"], "argument --log-level: invalid choice: 'VERBOSE'"),
], ids=["tp", "port", "memory", "max-model-len", "address", "seed", "log-level"])
def test_a_flag_out_of_its_range_is_a_usage_error_before_anything_starts(args, message):
    """serve restarted a data plane that died of --tp 0 for two minutes; a data plane given a
    malformed address lost its link thread and hung, passing its liveness probe."""
    result = splitserve(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("frontends", ["1", "0"])
def test_serve_on_a_port_another_server_holds_fails_instead_of_sharing_it(server, checkpoints,
                                                                            frontends):
    """gRPC binds with SO_REUSEPORT: a second server on the port started and took some of the
    first one's new connections."""
    result = splitserve("serve", "--model", str(checkpoints["untied"]), "--port",
                        str(server.port), "--frontends", frontends, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"port {server.port} of 127.0.0.1 is in use" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert not cleanup_lines(result.stderr), result.stderr
    assert server.client.model_info().max_model_len  # the first one still serves


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_stops_at_once_when_its_data_plane_refuses_its_flags(checkpoints):
    """The data plane exits 2 on a configuration error; serve used to restart it until its
    crash budget ran out, a traceback each time."""
    result = splitserve("serve", "--model", str(checkpoints["untied"]), "--port", "0",
                        "--device", "cuda", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "splitserve dataplane: error: --device cuda: torch sees no CUDA device" in result.stderr
    assert "refused its configuration" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert not cleanup_lines(result.stderr), result.stderr


def test_demo_model_into_a_file_is_an_error(tmp_path):
    (tmp_path / "taken").write_text("")
    result = splitserve("demo-model", str(tmp_path / "taken"), timeout=120)
    assert result.returncode == 2 and "is in the way of the default model" in result.stderr


def test_a_metrics_port_in_use_is_one_line_before_anything_starts(server, checkpoints):
    result = splitserve("serve", "--model", str(checkpoints["untied"]), "--port", "0",
                        "--metrics-port", str(server.port), timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"--metrics-port {server.port} of 127.0.0.1" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr and "never awaited" not in result.stderr


def test_a_link_address_in_use_is_one_line(checkpoints, tmp_path):
    """A second control plane on the first one's --dataplane-address: ZeroMQ's bind error was
    a traceback."""
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    first = harness.controlplane(checkpoints["untied"], tmp_path, link)
    try:
        result = splitserve("controlplane", "--model", str(checkpoints["untied"]), "--port", "0",
                            "--dataplane-address", link, timeout=120)
        assert result.returncode == 2, result.stderr
        assert f"--dataplane-address {link} is in use" in result.stderr.splitlines()[-1]
        assert "Traceback" not in result.stderr
        assert not cleanup_lines(result.stderr), result.stderr
    finally:
        first.stop()
