"""Run the containers of docker-compose.yml and of a rendered Kubernetes overlay as local
processes: the deployment files' own command lines, started the way tests/integration starts
hand-written ones (harness.Process).

A container has its own view of the world: its hostnames for the other containers, the ports it
listens on, its mounts. On one host they share a loopback interface and a file system, so a
`Container` translates that view: a peer's hostname and port -> 127.0.0.1 and the free local port
standing in for that peer's port; a wildcard or loopback address with one of its own ports ->
127.0.0.1 and the local stand-in; a mount target -> a directory under the test's tmp dir;
`splitserve ARGS` -> `python -m splitserve ARGS`. Nothing else is rewritten, so a wrong hostname,
port, path or flag in the files fails the test.
"""

import os
import pathlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from unittest import mock

from splitserve.client import Client
from tests.integration import harness

LOOPBACK = "127.0.0.1"
WAIT_S = 120  # bound on every wait for a process or a check
_SELF_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost"}
_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d+)")
_K8S_VAR = re.compile(r"\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class Container:
    name: str
    own_ports: dict[int, int]  # port this container listens on -> local stand-in
    peers: dict[tuple[str, int], int]  # (hostname, port) of a reachable peer -> local stand-in
    mounts: dict[str, pathlib.Path]  # mount target -> local directory
    env: dict[str, str] = field(default_factory=dict)

    def localize(self, value: str) -> str:
        value = _ADDRESS.sub(self._address, value)
        for target in sorted(self.mounts, key=len, reverse=True):
            if value == target or value.startswith(target + "/"):
                return str(self.mounts[target]) + value[len(target):]
        return value

    def _address(self, match: re.Match) -> str:
        host, port = match["host"], int(match["port"])
        if host in _SELF_HOSTS and port in self.own_ports:
            return f"{LOOPBACK}:{self.own_ports[port]}"
        if (host, port) in self.peers:
            return f"{LOOPBACK}:{self.peers[host, port]}"
        return match[0]

    def argv(self, command: list[str]) -> list[str]:
        """A container's `splitserve ...` command line as arguments of `python -m splitserve`."""
        assert command and command[0] == "splitserve", f"{self.name} runs {command}"
        args = command[1:]
        out = []
        for previous, arg in zip([None, *args], args):
            if previous in ("--port", "--metrics-port"):
                arg = str(self.own_ports[int(arg)])
            elif previous == "--host" and arg == "0.0.0.0":
                arg = LOOPBACK  # tests never listen on every interface
            else:
                arg = self.localize(arg)
            out.append(arg)
        return out

    def local_env(self) -> dict[str, str]:
        return {k: self.localize(v) for k, v in self.env.items()}

    def start(self, command: list[str], log_dir: pathlib.Path,
              extra_args: tuple[str, ...] = ()) -> harness.Process:
        for directory in self.mounts.values():
            directory.mkdir(parents=True, exist_ok=True)
        log = log_dir / (self.name.replace("/", "_") + ".log")
        with mock.patch.dict(os.environ, self.local_env()):
            return harness.Process([*self.argv(command), *extra_args], log)

    def run(self, command: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
        """A command run inside the container to its end: a healthcheck, an exec probe."""
        return subprocess.run([sys.executable, "-m", "splitserve", *self.argv(command)],
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **self.local_env()})


def wait_exit(process: harness.Process, timeout_s: float = WAIT_S) -> int:
    """Wait for a run-to-completion container (init container, one-shot service)."""
    try:
        process.popen.wait(timeout_s)
    finally:
        returncode = process.stop()
    assert returncode == 0, f"{process.popen.args} exited {returncode}:\n{process.log()}"
    return returncode


def wait_until(check, what: str, processes: list[harness.Process], timeout_s: float = WAIT_S,
               interval_s: float = 0.5) -> None:
    """Poll `check()` until true; fail early, with the logs, when a process has died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        dead = [p for p in processes if p.popen.poll() is not None]
        assert not dead, f"{what}: a process exited:\n" + "\n".join(p.log() for p in dead)
        time.sleep(interval_s)
    raise AssertionError(f"{what} not within {timeout_s}s:\n" +
                         "\n".join(p.log() for p in processes))


# -- docker-compose.yml ----------------------------------------------------------------------


class ComposeStack:
    """The services of one profile of `compose config`, brought up in depends_on order with
    Compose's conditions: started, healthy (its healthcheck passes), completed successfully."""

    def __init__(self, config: dict, tmp: pathlib.Path) -> None:
        self.services = config["services"]
        self.tmp = tmp
        self.ports = {name: {port: harness.free_port() for port in _compose_ports(svc)}
                      for name, svc in self.services.items()}
        self.containers = {name: self._container(name) for name in self.services}
        self.processes: dict[str, harness.Process] = {}

    def _container(self, name: str) -> Container:
        svc = self.services[name]
        peers = {(host, port): local
                 for other, other_svc in self.services.items()
                 if _compose_networks(svc) & _compose_networks(other_svc)
                 for host in _compose_hostnames(other, other_svc)
                 for port, local in self.ports[other].items()}
        mounts = {}
        for volume in svc.get("volumes", []):
            assert volume["type"] in ("volume", "bind"), volume
            mounts[volume["target"]] = (self.tmp / "volumes" / volume["source"]
                                        if volume["type"] == "volume"
                                        else pathlib.Path(volume["source"]))
        for target in svc.get("tmpfs", []):
            mounts[target] = self.tmp / "tmpfs" / name / target.strip("/").replace("/", "_")
        env = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
        return Container(name, self.ports[name], peers, mounts, env)

    def up(self, extra_args: dict[str, tuple[str, ...]] | None = None) -> None:
        for name in _dependency_order(self.services):
            for dependency, spec in (self.services[name].get("depends_on") or {}).items():
                if dependency not in self.services:
                    assert spec.get("required") is False, f"{name} needs {dependency}"
                    continue
                self._wait_for(dependency, spec["condition"])
            self.processes[name] = self.containers[name].start(
                self.services[name]["command"], self.tmp, (extra_args or {}).get(name, ()))

    def _wait_for(self, name: str, condition: str) -> None:
        if condition == "service_completed_successfully":
            if self.processes[name].popen.returncode is None:
                wait_exit(self.processes[name])
        elif condition == "service_healthy":
            wait_until(lambda: self.healthy(name), f"{name} healthy", [self.processes[name]])
        else:
            assert condition == "service_started", condition

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: healthcheck should be exec form, not {test[0]}"
        return self.containers[name].run(test[1:]).returncode == 0

    def published(self, name: str, target: int) -> str:
        """The host address Compose publishes the service's container port `target` on."""
        [port] = [p for p in self.services[name]["ports"] if p["target"] == target]
        return f"{port['host_ip']}:{self.ports[name][target]}"

    def down(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()


def _compose_ports(svc: dict) -> set[int]:
    return ({p["target"] for p in svc.get("ports", [])} |
            {int(port) for port in svc.get("expose", [])})


def _compose_networks(svc: dict) -> set[str]:
    if svc.get("network_mode") == "none":
        return set()
    return set(svc.get("networks") or {"default": None})


def _compose_hostnames(name: str, svc: dict) -> set[str]:
    aliases = {alias for network in (svc.get("networks") or {}).values() if network
               for alias in network.get("aliases", [])}
    return {name} | aliases


def _dependency_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {path}"
        if name in order or name not in services:
            return
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency, (*path, name))
        order.append(name)

    for name in sorted(services):
        visit(name, ())
    return order


# -- a rendered Kubernetes overlay -----------------------------------------------------------


class KubePods:
    """One pod per Deployment of a render. Each pod's init containers run in order, pods in
    parallel, then every pod's containers start. Services resolve to the one pod their selector
    picks, through their targetPort; probes run as the kubelet would run them."""

    def __init__(self, docs: list[dict], tmp: pathlib.Path) -> None:
        kinds = {d["kind"] for d in docs}
        assert not kinds & {"StatefulSet", "LeaderWorkerSet", "DaemonSet"}, kinds
        self.tmp = tmp
        self.namespace = next(d["metadata"].get("namespace", "default") for d in docs
                              if d["kind"] == "Deployment")
        self.configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs
                           if d["kind"] == "ConfigMap"}
        self.pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs
                     if d["kind"] == "Deployment"}
        self.ports = {pod: {p["containerPort"]: harness.free_port()
                            for c in template["spec"]["containers"] for p in c.get("ports", [])}
                      for pod, template in self.pods.items()}
        self.peers = self._service_peers([d for d in docs if d["kind"] == "Service"])
        self.containers = {(pod, c["name"]): self._container(pod, c)
                           for pod, template in self.pods.items()
                           for c in [*template["spec"].get("initContainers", []),
                                     *template["spec"]["containers"]]}
        self.processes: dict[tuple[str, str], harness.Process] = {}

    def _service_peers(self, services: list[dict]) -> dict[tuple[str, int], int]:
        peers = {}
        for svc in services:
            selector = svc["spec"]["selector"]
            [pod] = [p for p, t in self.pods.items()
                     if selector.items() <= t["metadata"]["labels"].items()]
            name, ns = svc["metadata"]["name"], self.namespace
            for port in svc["spec"]["ports"]:
                container_port = self._container_port(pod, port.get("targetPort", port["port"]))
                for host in (name, f"{name}.{ns}", f"{name}.{ns}.svc",
                             f"{name}.{ns}.svc.cluster.local"):
                    peers[host, port["port"]] = self.ports[pod][container_port]
        return peers

    def _container_port(self, pod: str, target: int | str) -> int:
        if isinstance(target, int):
            return target
        [port] = [p["containerPort"] for c in self.pods[pod]["spec"]["containers"]
                  for p in c.get("ports", []) if p.get("name") == target]
        return port

    def _container(self, pod: str, container: dict) -> Container:
        assert "command" not in container, \
            f"{pod}/{container['name']} sets `command`, which replaces the image's init entrypoint"
        volumes = {v["name"]: v for v in self.pods[pod]["spec"].get("volumes", [])}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            assert "emptyDir" in volume, f"{pod}: only emptyDir volumes run locally: {volume}"
            mounts[mount["mountPath"]] = self.tmp / "pods" / pod / mount["name"]
        return Container(f"{pod}/{container['name']}", self.ports[pod], self.peers, mounts,
                         self._env(container))

    def _env(self, container: dict) -> dict[str, str]:
        env = {}
        for source in container.get("envFrom", []):
            env.update(self.configmaps[source["configMapRef"]["name"]])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = _expand(var["value"], env)
            else:
                ref = var["valueFrom"]["configMapKeyRef"]
                env[var["name"]] = self.configmaps[ref["name"]][ref["key"]]
        return env

    def spec(self, pod: str, name: str) -> dict:
        template = self.pods[pod]["spec"]
        [container] = [c for c in [*template.get("initContainers", []), *template["containers"]]
                       if c["name"] == name]
        return container

    def command(self, pod: str, name: str) -> list[str]:
        container = self.containers[pod, name]
        return [_expand(arg, container.env) for arg in self.spec(pod, name)["args"]]

    def up(self, extra_args: dict[str, tuple[str, ...]] | None = None) -> None:
        self._run_init_containers()
        for pod, template in self.pods.items():
            for c in template["spec"]["containers"]:
                self.processes[pod, c["name"]] = self.containers[pod, c["name"]].start(
                    self.command(pod, c["name"]), self.tmp, (extra_args or {}).get(c["name"], ()))

    def _run_init_containers(self) -> None:
        """Each pod's init containers in order, the pods side by side."""
        queues = {pod: [c["name"] for c in t["spec"].get("initContainers", [])]
                  for pod, t in self.pods.items()}
        while any(queues.values()):
            running = []
            for pod, queue in queues.items():
                if queue:
                    name = queue.pop(0)
                    process = self.containers[pod, name].start(self.command(pod, name), self.tmp)
                    self.processes[pod, name] = process
                    running.append(process)
            for process in running:
                wait_exit(process)

    def probe(self, pod: str, name: str, kind: str) -> bool:
        """Run the container's `kind` probe (startupProbe, livenessProbe, readinessProbe) once."""
        probe = self.spec(pod, name)[kind]
        timeout_s = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            port = self.containers[pod, name].own_ports[probe["grpc"]["port"]]
            with Client(f"{LOOPBACK}:{port}") as client:
                return client.is_serving(probe["grpc"].get("service", ""), timeout=timeout_s)
        return self.containers[pod, name].run(probe["exec"]["command"],
                                              timeout_s=max(timeout_s, 30)).returncode == 0

    def service(self, name: str, port: int) -> str:
        return f"{LOOPBACK}:{self.peers[name, port]}"

    def down(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values (unknown names stay as they are)."""
    return _K8S_VAR.sub(lambda m: env.get(m["name"], m[0]), value)
