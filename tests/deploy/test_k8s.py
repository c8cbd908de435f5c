"""k8s/: every overlay renders with `kubectl kustomize` and passes `kubernetes-validate
--strict`; its pods meet the restricted Pod Security Standard and carry the probes, volumes,
GPU limits, Services, NetworkPolicy and disruption settings docs/deploy.md describes; and the
cpu-demo overlay's containers, run as local processes from the rendered commands, serve a
Generate through the gRPC Service."""

import functools
import re

import pytest
import yaml

from splitserve.client import Client
from tests.deploy import local, tools
from tests.deploy.tools import OVERLAYS, by_kind, pod_templates

pytestmark = pytest.mark.timeout(120)
overlays = pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"overlay-{o}")

GPU_OVERLAYS = {"gpu": 1, "gpu-tp2": 2, "multinode": 1}  # GPUs per data-plane pod
K8S_VERSIONS = ["1.31", "1.37"]  # oldest supported minor (docs/deploy.md) and the newest schema
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


@functools.cache
def render(overlay: str) -> tuple:
    return tuple(tools.kustomize(overlay))


def containers(template: dict, init: bool = True) -> list[dict]:
    spec = template["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def role(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def labels_of(overlay: str, component: str) -> dict:
    [labels] = [t["metadata"]["labels"] for t in pod_templates(list(render(overlay))).values()
                if role(t) == component][:1]
    return labels


# -- rendering and schemas -------------------------------------------------------------------


@overlays
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_renders_and_passes_kubernetes_validate(overlay, version, tmp_path):
    validate = tools.require_tool("kubernetes-validate")
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(render(overlay)))
    result = tools.run_tool([validate, "--strict", "-k", version, str(rendered)])
    assert result.returncode == 0, result.stdout + result.stderr
    unchecked = set(re.findall(r"Couldn't find schema for kind (\w+)", result.stdout))
    assert unchecked <= {"LeaderWorkerSet"}, result.stdout
    if unchecked:  # a CRD: its pod templates are checked as core PodTemplates instead
        templates = [{"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": name.replace("/", "-")}, "template": template}
                     for name, template in pod_templates(list(render(overlay))).items()]
        (tmp_path / "templates.yaml").write_text(yaml.safe_dump_all(templates))
        result = tools.run_tool([validate, "--strict", "-k", version,
                                 str(tmp_path / "templates.yaml")])
        assert result.returncode == 0, result.stdout + result.stderr


def test_leaderworkerset_uses_only_fields_of_its_api():
    # leaderworkerset.x-k8s.io/v1 (kubernetes-sigs/lws api/leaderworkerset/v1), the fields used.
    [lws] = by_kind(list(render("multinode")), "LeaderWorkerSet").values()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                         "networkConfig"}
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    template = spec["leaderWorkerTemplate"]
    assert set(template) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                             "subGroupPolicy", "volumeClaimTemplates"}
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert spec["replicas"] == 1


# -- pod security ----------------------------------------------------------------------------


@overlays
def test_pods_meet_the_restricted_pod_security_standard(overlay):
    for name, template in pod_templates(list(render(overlay))).items():
        spec = template["spec"]
        pod_context = spec["securityContext"]
        assert pod_context["runAsNonRoot"] is True and pod_context["runAsUser"] != 0, name
        assert pod_context["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec), name
        assert spec["automountServiceAccountToken"] is False, name
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, (name, volume)
        for container in containers(template):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])
            assert not context.get("privileged"), (name, container["name"])
            assert all("hostPort" not in p for p in container.get("ports", []))
            writable = {m["mountPath"] for m in container.get("volumeMounts", [])
                        if not m.get("readOnly")}
            assert "/tmp" in writable, f"{name}/{container['name']}: no writable /tmp"


def test_the_namespace_enforces_restricted_pod_security():
    for overlay in OVERLAYS:
        [namespace] = by_kind(list(render(overlay)), "Namespace").values()
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@overlays
def test_containers_run_splitserve_under_the_image_entrypoint(overlay):
    # `command` would replace the images' dumb-init entrypoint, which forwards SIGTERM.
    for name, template in pod_templates(list(render(overlay))).items():
        for container in containers(template):
            assert "command" not in container, (name, container["name"])
            assert container["args"][0] == "splitserve", (name, container["name"])


# -- probes, volumes, GPUs -------------------------------------------------------------------


@overlays
def test_probes(overlay):
    for name, template in pod_templates(list(render(overlay))).items():
        [container] = containers(template, init=False)
        if role(template) == "controlplane":
            assert container["readinessProbe"]["grpc"] == {"port": 50051}  # service "": attached
            for kind in ("startupProbe", "livenessProbe"):
                assert container[kind]["grpc"] == {"port": 50051, "service": "liveness"}, kind
        else:
            liveness_file = flag(container["args"], "--liveness-file")
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                command = container[kind]["exec"]["command"]
                assert command[:3] == ["splitserve", "health", "--file"], kind
                assert flag(command, "--file") == liveness_file, kind
            startup = container["startupProbe"]
            budget_s = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget_s >= (600 if overlay in GPU_OVERLAYS else 120), \
                f"{name}: {budget_s}s to load weights"


@overlays
def test_weights_shared_memory_and_gpus(overlay):
    for name, template in pod_templates(list(render(overlay))).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        [container] = containers(template, init=False)
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        model_dir = flag(container["args"], "--model")
        assert model_dir == "$(SPLITSERVE_MODEL_DIR)", name
        assert mounts["/models"]["readOnly"] is True, name
        models = volumes[mounts["/models"]["name"]]
        if overlay == "cpu-demo":  # written into an emptyDir by the pod's init container
            assert "emptyDir" in models
            [init] = template["spec"]["initContainers"]
            assert init["args"][:2] == ["splitserve", "demo-model"]
        else:
            assert models["persistentVolumeClaim"]["readOnly"] is True, name
        if role(template) != "dataplane":
            continue
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"], name
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory", name
        limits = container["resources"]["limits"]
        if overlay in GPU_OVERLAYS:
            assert flag(container["args"], "--device") == "cuda"
            assert limits["nvidia.com/gpu"] == GPU_OVERLAYS[overlay], name
            if overlay != "multinode":
                assert flag(container["args"], "--tp") == str(GPU_OVERLAYS[overlay])
        else:
            assert flag(container["args"], "--device") == "cpu"
            assert "nvidia.com/gpu" not in limits


def test_multinode_runs_one_rank_per_pod():
    [lws] = by_kind(list(render("multinode")), "LeaderWorkerSet").values()
    [container] = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    args = container["args"]
    assert flag(args, "--tp") == "$(LWS_GROUP_SIZE)"
    assert flag(args, "--rank") == "$(LWS_WORKER_INDEX)"
    port = int(flag(args, "--dist-init-method").rsplit(":", 1)[1])
    assert flag(args, "--dist-init-method") == f"tcp://$(LWS_LEADER_ADDRESS):{port}"
    assert {"name": "rendezvous", "containerPort": port} in container["ports"]
    assert "splitserve-dataplane" not in by_kind(list(render("multinode")), "Deployment")


# -- Services, NetworkPolicy, disruptions ----------------------------------------------------


@overlays
def test_services_reach_the_control_plane(overlay):
    docs = list(render(overlay))
    services = by_kind(docs, "Service")
    templates = pod_templates(docs)
    [controlplane] = [t for t in templates.values() if role(t) == "controlplane"]
    ports = {p["name"]: p["containerPort"] for p in controlplane["spec"]["containers"][0]["ports"]}
    for name, port_name, port in (("splitserve", "grpc", 50051), ("splitserve-link", "link", 5555)):
        spec = services[name]["spec"]
        assert selects({"matchLabels": spec["selector"]}, controlplane["metadata"]["labels"])
        assert [p["port"] for p in spec["ports"]] == [port]
        assert ports[spec["ports"][0]["targetPort"]] == port
    # The control plane is ready only once a data plane attached through this Service.
    assert services["splitserve-link"]["spec"]["publishNotReadyAddresses"] is True
    for template in templates.values():
        if role(template) == "dataplane":
            args = template["spec"]["containers"][0]["args"]
            assert flag(args, "--controlplane-address") == "tcp://splitserve-link:5555"


@overlays
def test_network_policy_opens_the_link_only_to_data_planes(overlay):
    policies = by_kind(list(render(overlay)), "NetworkPolicy").values()
    controlplane, dataplane = labels_of(overlay, "controlplane"), labels_of(overlay, "dataplane")
    ingress = [rule for policy in policies if selects(policy["spec"]["podSelector"], controlplane)
               for rule in policy["spec"].get("ingress", [])]
    # A rule without ports opens every port, the link's included.
    link_rules = [rule for rule in ingress if not rule.get("ports")
                  or any(p["port"] == 5555 for p in rule["ports"])]
    assert link_rules, "no ingress rule mentions the link port"
    for rule in link_rules:
        peers = rule.get("from")
        assert peers, f"the link port is open to everyone: {rule}"
        for peer in peers:
            assert set(peer) == {"podSelector"}, peer  # no ipBlock, no other namespace
            assert selects(peer["podSelector"], dataplane)
            assert not selects(peer["podSelector"], controlplane)
    egress = [rule for policy in policies if selects(policy["spec"]["podSelector"], dataplane)
              for rule in policy["spec"].get("egress", [])]
    assert any(any(selects(peer["podSelector"], controlplane) for peer in rule.get("to", []))
               and {"port": 5555, "protocol": "TCP"} in rule["ports"] for rule in egress)


@overlays
def test_disruption_budgets_and_graceful_termination(overlay):
    docs = list(render(overlay))
    budgets = by_kind(docs, "PodDisruptionBudget").values()
    for name, template in pod_templates(docs).items():
        labels = template["metadata"]["labels"]
        [budget] = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        assert budget["spec"]["maxUnavailable"] == 0, name
        [container] = containers(template, init=False)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", name
        # preStop, then the control plane's drain on SIGTERM (30 s by default), then exit.
        assert template["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + 30, name


# -- the cpu-demo overlay, running -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_demo_overlay_serves_generate_through_the_service(tmp_path):
    pods = local.KubePods(list(render("cpu-demo")), tmp_path)
    controlplane, dataplane = ("splitserve-controlplane", "controlplane"), \
        ("splitserve-dataplane", "dataplane")
    try:
        # The rendered commands as written, plus a small KV cache for CI.
        pods.up(extra_args={"dataplane": ("--num-kv-blocks", "256")})
        running = [pods.processes[controlplane], pods.processes[dataplane]]
        for container in (controlplane, dataplane):
            local.wait_until(lambda: pods.probe(*container, "startupProbe"),
                             f"{container} startup probe", running)
        local.wait_until(lambda: pods.probe(*controlplane, "readinessProbe"),
                         "control plane ready (a data plane attached)", running)
        with Client(pods.service("splitserve", 50051)) as client:
            completion = client.generate("Once upon a time", max_tokens=8, temperature=0,
                                         ignore_eos=True, timeout=60)
        assert (completion.completion_tokens, completion.finish_reason) == (8, "length")
        for container in (controlplane, dataplane):
            for kind in ("livenessProbe", "readinessProbe"):
                assert pods.probe(*container, kind), (container, kind)
    finally:
        pods.down()
