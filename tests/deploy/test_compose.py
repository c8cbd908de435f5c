"""docker-compose.yml: each profile passes `compose config` (the real Compose binary), keeps the
hardening the issue asks for, and the cpu profile's services, run as local processes from the
file's own commands, serve a Generate through the published port."""

import pytest

from splitserve.client import Client
from tests.deploy import local
from tests.deploy.tools import COMPOSE_FILE, COMPOSE_PROFILES, ROOT, compose_binary, \
    compose_config, compose_env, run_tool

LONG_RUNNING = {"controlplane", "dataplane-cpu", "dataplane-gpu"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", COMPOSE_PROFILES, ids=lambda p: f"{p}-profile")
def test_compose_config_accepts_the_profile(profile):
    result = run_tool([compose_binary(), "-f", str(COMPOSE_FILE), "--profile", profile, "config",
                       "--quiet"], env=compose_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    services = set(compose_config(profile)["services"])
    expected = {"cpu": {"model-init", "controlplane", "dataplane-cpu"},
                "gpu": {"controlplane", "dataplane-gpu"}}[profile]
    assert services == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", COMPOSE_PROFILES, ids=lambda p: f"{p}-profile")
def test_services_are_hardened(profile):
    config = compose_config(profile)
    for name, svc in config["services"].items():
        assert svc["read_only"] is True, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert "/tmp" in svc["tmpfs"], name
        if name != "model-init":  # the one writer: it fills the demo model's volume
            assert all(v["read_only"] for v in svc["volumes"] if v["target"] == "/models"), \
                f"{name} mounts weights rw"
            assert {v["target"] for v in svc["volumes"] if not v.get("read_only")} <= \
                {"/var/cache/splitserve"}, f"{name} writes where it should not"
        if name in LONG_RUNNING:
            assert svc["restart"] == "unless-stopped", name
            assert svc["healthcheck"]["test"][:3] == ["CMD", "splitserve", "health"], name
    dataplane = config["services"][f"dataplane-{profile}"]
    assert int(dataplane["shm_size"]) >= 256 << 20
    assert dataplane["depends_on"]["controlplane"]["condition"] == "service_healthy"
    assert set(dataplane["networks"]) == {"link"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", COMPOSE_PROFILES, ids=lambda p: f"{p}-profile")
def test_only_grpc_is_published_and_only_on_loopback(profile):
    config = compose_config(profile)
    published = [(name, p) for name, svc in config["services"].items()
                 for p in svc.get("ports", [])]
    assert [(name, p["target"], p["host_ip"]) for name, p in published] == \
        [("controlplane", 50051, "127.0.0.1")]
    assert config["networks"]["link"]["internal"] is True
    assert "5555" in config["services"]["controlplane"]["expose"]


@pytest.mark.timeout(120)
def test_gpu_dataplane_keeps_its_compiled_kernels_across_restarts():
    """/tmp is a tmpfs a restart empties: Triton's and FA4's caches live on a named volume, whose
    mount point the image creates for its user (a new volume takes that owner)."""
    config = compose_config("gpu")
    dataplane = config["services"]["dataplane-gpu"]
    [cache] = [v for v in dataplane["volumes"] if v["target"] == "/var/cache/splitserve"]
    assert cache["type"] == "volume" and cache["source"] in config["volumes"]
    env = dataplane["environment"]
    for name in ("TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        assert env[name].startswith("/var/cache/splitserve/"), name
    dockerfile = (ROOT / "docker" / "dataplane.Dockerfile").read_text()
    assert "chown 10001:10001 /models /var/cache/splitserve" in dockerfile


@pytest.mark.timeout(120)
def test_gpu_profile_reserves_nvidia_gpus():
    devices = compose_config("gpu")["services"]["dataplane-gpu"]["deploy"]["resources"][
        "reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    command = compose_config("gpu")["services"]["dataplane-gpu"]["command"]
    assert command[command.index("--device") + 1] == "cuda"
    assert command[command.index("--tp") + 1] == "1"  # = the GPUs reserved (SPLITSERVE_TP)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_profile_serves_generate_through_the_published_port(tmp_path):
    stack = local.ComposeStack(compose_config("cpu"), tmp_path)
    try:
        # The file's commands as written, plus a small KV cache for CI.
        stack.up(extra_args={"dataplane-cpu": ("--num-kv-blocks", "256")})
        address = stack.published("controlplane", 50051)
        with Client(address) as client:
            assert client.wait_until_serving(local.WAIT_S), stack.processes["dataplane-cpu"].log()
            completion = client.generate("The quick brown fox", max_tokens=8, temperature=0,
                                         ignore_eos=True, timeout=60)
            assert (completion.completion_tokens, completion.finish_reason) == (8, "length")
            assert client.model_info().tp_size == 1
        for name in ("controlplane", "dataplane-cpu"):
            assert stack.healthy(name), name
        readiness = stack.containers["controlplane"].run(
            ["splitserve", "health", "--address", "127.0.0.1:50051"])
        assert readiness.returncode == 0, readiness.stdout + readiness.stderr
    finally:
        stack.down()
