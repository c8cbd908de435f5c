"""Data-plane faults with real processes and real signals: no request lost, duplicated or hung,
no KV block leaked, no process orphaned."""

import concurrent.futures
import datetime
import os
import pathlib
import re
import signal
import socket
import tempfile
import threading
import time

import grpc
import pytest

from protos import generation_pb2
from tests.integration import harness
from tests.integration.chaos_proxy import ChaosProxyProcess, Faults
from tests.reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 99, 3, 250, 7, 81], [11, 2, 3], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [42, 42, 42, 42, 42], list(range(60, 90))]
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def model(checkpoints):
    return checkpoints["untied"]


@pytest.fixture(scope="module")
def expected(model):
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


class InFlight:
    """Greedy streams in threads; `started` is set once every stream has some tokens."""

    def __init__(self, client, prompts=PROMPTS, max_tokens=MAX_TOKENS, min_chunks=3) -> None:
        self.results: list = [None] * len(prompts)
        self.details: list[str | None] = [None] * len(prompts)  # an error status's
        self._seen = [0] * len(prompts)
        self.started = threading.Event()
        self._min_chunks = min_chunks
        self._pool = concurrent.futures.ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(self._run, client, i, p, max_tokens)
                         for i, p in enumerate(prompts)]

    def _run(self, client, i, prompt, max_tokens):
        tokens, last = [], None
        try:
            for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True, timeout=120):
                tokens.extend(chunk.token_ids)
                last = chunk
                self._seen[i] += 1
                if min(self._seen) >= self._min_chunks:
                    self.started.set()
        except grpc.RpcError as e:
            self.started.set()
            self.details[i] = e.details()
            return e.code().name, tokens
        return generation_pb2.FinishReason.Name(last.finish_reason), tokens

    def wait(self, timeout_s: float = 120):
        results = [f.result(timeout_s) for f in self._futures]
        self._pool.shutdown()
        return results


def log_time(line: str) -> float:
    stamp = re.match(r"(\d+-\d+-\d+ \d+:\d+:\d+,\d+)", line).group(1)
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_log_after(log: str, pattern: str, after: float) -> float | None:
    for line in log.splitlines():
        if re.search(pattern, line) and re.match(r"\d{4}-", line) and log_time(line) >= after:
            return log_time(line)
    return None


def descendants_running(pid: int, word: str) -> list[int]:
    """The live processes below `pid` whose command line has `word`."""
    return [p for p in harness.descendants(pid) if word in harness.cmdline(p)]


def dataplane_pid(server) -> int:
    [launcher] = [p for p in descendants_running(server.processes[0].popen.pid, "dataplane")
                  if "--rank" not in harness.cmdline(p)][:1]
    return launcher


def frontend_pid(server) -> int:
    [pid] = descendants_running(server.processes[0].popen.pid, "frontend")
    return pid


def port_is_free(port: int) -> bool:
    """Whether another program could bind the port now (SO_REUSEADDR: a dead server's
    connections in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_killed_frontend_ends_its_streams_frees_their_blocks_and_is_restarted(model, tmp_path):
    """The front-end holds the client connections: kill -9 cuts its streams (the clients see
    UNAVAILABLE), the engine ends their requests once the front-end is silent, running and
    queued alike (no KV block stays taken), and a new front-end serves on the same port, which
    another program could not take meanwhile (while the restart binds it, the check shows
    nothing: it runs at once, before the 0.5 s restart delay)."""
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "512", "--max-num-seqs", "2")
    try:
        # fifty rounds of two long requests: work left when the engine gives up on the
        # front-end 3-4 s after the kill, however fast the machine
        prompts = [[i + 1, 2, 3] for i in range(100)]
        flight = InFlight(server.client, prompts=prompts, max_tokens=None, min_chunks=0)
        assert flight.started.wait(60)
        # the kill comes once most calls have reached the engine (the first token can come
        # back before the client threads have sent them all)
        assert harness.wait_until(lambda: server.client.load().num_waiting >= 50, 30)
        killed = frontend_pid(server)
        os.kill(killed, signal.SIGKILL)
        assert harness.wait_until(lambda: not harness.alive(killed), 10)
        assert not port_is_free(int(server.address.rsplit(":", 1)[1]))  # kept for the next one
        assert [r[0] for r in flight.wait()] == ["UNAVAILABLE"] * len(prompts)
        ended = server.processes[0].wait_for_log(r"front-end went silent; ending its (\d+) calls",
                                                 timeout_s=15)
        assert int(ended.group(1)) > 0
        server.wait_serving()  # the restarted front-end
        assert frontend_pid(server) != killed
        assert server.wait_idle()
        completion = server.client.generate([1, 2, 3], ignore_eos=True, max_tokens=4)
        assert completion.completion_tokens == 4
    finally:
        server.stop()


def test_a_stalled_frontend_loses_no_token(model, tmp_path):
    """SIGSTOP of the front-end for 1 s (its last Hello about 1 s before, later on a loaded
    machine: under the engine's 3 s silence limit) while 128 streams run: the engine's replies
    wait for it, and every stream ends complete. (tests/controlplane/test_frontend.py shows that
    no reply is dropped however many queue.)"""
    num_streams, max_tokens = 128, 500
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "4096", "--max-num-seqs",
                           str(num_streams))
    try:
        prompts = [[i + 1, 2, 3] for i in range(num_streams)]
        flight = InFlight(server.client, prompts=prompts, max_tokens=max_tokens, min_chunks=1)
        assert flight.started.wait(60)
        stalled = frontend_pid(server)
        os.kill(stalled, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(stalled, signal.SIGCONT)
        results = flight.wait()
        assert [r[0] for r in results] == ["FINISH_REASON_LENGTH"] * num_streams
        assert [len(r[1]) for r in results] == [max_tokens] * num_streams
    finally:
        server.stop()


def test_a_frozen_control_plane_keeps_its_data_plane(model, expected, tmp_path):
    """SIGSTOP of the engine for 2.5 s, past the link's 1.5 s heartbeat timeout, while streams
    run: the data plane hears nothing, keeps its epoch and says Hello in it. Once the engine
    runs again it resumes that data plane: no loss, no restart (on a GPU a restart costs a
    weight load), and every stream completes unchanged."""
    server = harness.serve(model, tmp_path, "--block-size", "4", "--num-kv-blocks", "512")
    try:
        flight = InFlight(server.client)
        assert flight.started.wait(60)
        dataplane = dataplane_pid(server)
        engine = server.processes[0].popen.pid
        os.kill(engine, signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(engine, signal.SIGCONT)
        results = flight.wait()
        assert [r[0] for r in results] == ["FINISH_REASON_LENGTH"] * len(PROMPTS)
        assert [r[1] for r in results] == expected
        assert server.client.load().num_dataplane_losses == 0
        assert dataplane_pid(server) == dataplane
        assert "resumed in epoch" in server.processes[0].log_path.read_text()
    finally:
        server.stop()


def test_a_hung_engine_ends_its_frontends_calls_unavailable(model, tmp_path):
    """The engine process hangs without dying (SIGSTOP): after 10 s without a word from it the
    front-end ends its calls UNAVAILABLE (streams without a deadline waited forever) and turns
    new ones away; once the engine runs again, those calls' requests are gone (their blocks
    freed) and it serves as before."""
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "512")
    engine = server.processes[0].popen.pid
    try:
        flight = InFlight(server.client, max_tokens=None, min_chunks=1)
        assert flight.started.wait(60)
        os.kill(engine, signal.SIGSTOP)
        try:
            assert [r[0] for r in flight.wait()] == ["UNAVAILABLE"] * len(PROMPTS)
            with pytest.raises(grpc.RpcError) as error:
                server.client.generate([1, 2], max_tokens=2, timeout=30)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(engine, signal.SIGCONT)
        server.wait_serving()
        assert server.wait_idle(30)
        assert server.client.generate([1, 2], ignore_eos=True, max_tokens=2).completion_tokens == 2
    finally:
        server.stop()


def test_kill_9_cycles_lose_nothing(model, expected, tmp_path):
    server = harness.serve(model, tmp_path, "--block-size", "4", "--num-kv-blocks", "512")
    figures = []
    try:
        for cycle in range(3):
            flight = InFlight(server.client)
            assert flight.started.wait(60)
            killed_at = time.time()
            os.kill(dataplane_pid(server), signal.SIGKILL)
            results = flight.wait()
            assert [r[0] for r in results] == ["FINISH_REASON_LENGTH"] * len(PROMPTS)
            assert [r[1] for r in results] == expected, f"cycle {cycle}"
            assert server.wait_idle()
            log = server.log()
            lost = first_log_after(log, r"data plane \w+ lost", killed_at)
            ready = first_log_after(log, r"data plane \w+ ready", killed_at)
            figures.append((lost - killed_at, ready - killed_at))
        assert server.client.load().num_dataplane_losses == 3
    finally:
        server.stop()
    print("\nkill -9 cycles: detect / recover seconds:",
          [(round(d, 3), round(r, 2)) for d, r in figures])


def test_an_idle_data_plane_killed_is_logged_with_the_links_reason(model, tmp_path):
    """kill -9 of the data plane with nothing running: the engine's line gives the reason the
    link lost it for (it said "the link reports the data plane gone")."""
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "64")
    try:
        os.kill(dataplane_pid(server), signal.SIGKILL)
        process = server.processes[0]
        link = process.wait_for_log(r"splitserve\.link: data plane \w+ lost: (.*)", 30)
        engine = process.wait_for_log(
            r"splitserve\.engine: data plane lost \((.*)\); no requests were running", 30)
        assert engine.group(1) == link.group(1), process.log()
    finally:
        server.stop()


def test_kill_9_without_replacement_ends_streams_unavailable(model, tmp_path):
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link, "--reattach-timeout", "2")
    dataplane = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "512")
    server.processes.append(dataplane)
    try:
        server.wait_serving()
        flight = InFlight(server.client, max_tokens=400)
        assert flight.started.wait(60)
        killed_at = time.monotonic()
        dataplane.popen.send_signal(signal.SIGKILL)
        results = flight.wait()
        ended_after = time.monotonic() - killed_at
        assert [r[0] for r in results] == ["UNAVAILABLE"] * len(PROMPTS)
        assert not server.client.is_serving()
        with pytest.raises(grpc.RpcError) as error:
            server.client.generate([1, 2], max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        # a data plane that comes back is used again
        server.processes.append(harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "512",
                                                  name="dataplane2"))
        server.wait_serving()
        assert server.client.generate([1, 2], ignore_eos=True, max_tokens=2).completion_tokens == 2
    finally:
        server.stop()
    print(f"\nno replacement: streams ended UNAVAILABLE {ended_after:.2f}s after the kill "
          "(--reattach-timeout 2)")


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_sigstop_of_a_rank_is_detected_and_recovered(model, expected, tmp_path, tp, rank):
    server = harness.serve(model, tmp_path, "--tp", str(tp), "--block-size", "4",
                           "--num-kv-blocks", "512", "--step-timeout", "30")
    try:
        launcher = dataplane_pid(server)
        target = launcher if rank == 0 else harness.descendants(launcher)[0]
        flight = InFlight(server.client, min_chunks=5)  # past the step deadline's warm-up
        assert flight.started.wait(60)
        stopped_at = time.time()
        os.kill(target, signal.SIGSTOP)
        results = flight.wait()
        assert [r[1] for r in results] == expected
        assert harness.wait_until(lambda: not harness.alive(target), 10), "the frozen rank lives on"
        lost = first_log_after(server.log(), r"data plane \w+ lost", stopped_at)
        reason = re.search(r"lost: (.*)", server.log()[server.log().index("lost:") - 80:]).group(1)
    finally:
        server.stop()
    print(f"\nSIGSTOP rank {rank} of tp={tp}: detected after {lost - stopped_at:.2f}s ({reason})")


def test_no_child_process_outlives_a_killed_control_plane(model, tmp_path):
    server = harness.serve(model, tmp_path, "--tp", "2", "--num-kv-blocks", "64")
    serve_pid = server.processes[0].popen.pid
    children = harness.descendants(serve_pid)
    assert len(children) == 3  # two data-plane ranks and the gRPC front-end
    server.processes[0].popen.send_signal(signal.SIGKILL)
    server.processes[0].popen.wait(10)
    assert harness.wait_until(lambda: not any(harness.alive(p) for p in children), 5)
    server.stop()


def test_standalone_dataplane_exits_when_its_control_plane_is_gone(model, tmp_path):
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link)
    dataplane = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "64",
                                  "--controlplane-grace", "2")
    server.processes.append(dataplane)
    try:
        server.wait_serving()
        server.processes[0].popen.send_signal(signal.SIGKILL)
        assert dataplane.popen.wait(15) == 3
    finally:
        server.stop()


def test_a_control_plane_stopped_with_sigterm_leaves_its_data_plane_to_the_next(model, tmp_path):
    """A rolling update of the control plane: the old one stops on SIGTERM, and its standalone
    data plane keeps its weights and serves the new one on the same address (the old one's
    goodbye used to be a Reject, on which a data plane exits: a reload). The data plane hears
    the goodbye and waits without a warning (it warned 'control plane silent' once its
    heartbeats stopped)."""
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    first = harness.controlplane(model, tmp_path / "first", link)
    dataplane = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "64")
    second = None
    try:
        first.wait_serving()
        assert first.processes[0].stop() == 0
        dataplane.wait_for_log(r"INFO splitserve\.dataplane: control plane closed; waiting", 30)
        second = harness.controlplane(model, tmp_path / "second", link)
        second.wait_serving()
        assert dataplane.popen.poll() is None, dataplane.log()
        completion = second.client.generate([1, 2, 3], ignore_eos=True, max_tokens=4)
        assert completion.completion_tokens == 4
        assert dataplane.log().count(" loaded ") == 1  # the weights, once
        assert "control plane silent" not in dataplane.log(), dataplane.log()
    finally:
        for server in (first, second):
            if server is not None:
                server.stop()
        dataplane.stop()


def test_a_standby_data_plane_waits_quietly_and_takes_over_from_one_stopped_with_sigterm(
        model, tmp_path):
    """A second data plane on an attached control plane is a standby: each side says so once
    (its repeated Hellos and their refusals are DEBUG lines), not an ERROR a second. The
    attached one stops on SIGTERM with exit 0 and a line that says why, and the standby takes
    over."""
    link = f"tcp://127.0.0.1:{harness.free_port()}"
    server = harness.controlplane(model, tmp_path, link, "--log-level", "debug")
    first = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "64", name="first")
    server.processes.append(first)
    try:
        server.wait_serving()
        standby = harness.dataplane(model, tmp_path, link, "--num-kv-blocks", "64",
                                    "--log-level", "debug", name="standby")
        server.processes.append(standby)
        refusals = r"DEBUG splitserve\.link: refusing data plane"
        assert harness.wait_until(lambda: len(re.findall(refusals, server.log())) >= 3, 30), \
            server.log()
        for process, once in ((server.processes[0], "is a standby:"),
                              (standby, "INFO splitserve.dataplane: standby:")):
            assert process.log().count(once) == 1, process.log()
            assert " ERROR " not in process.log(), process.log()
        assert first.stop() == 0
        assert "stopping on SIGTERM" in first.log(), first.log()
        assert server.client.wait_until_serving(30), server.log()
        assert server.client.generate([1, 2, 3], ignore_eos=True, max_tokens=4
                                      ).completion_tokens == 4
    finally:
        server.stop()


class Restarting:
    """Keeps a standalone data plane running, as an orchestrator would."""

    def __init__(self, model, tmp_path, link) -> None:
        self.args = (model, tmp_path, link, "--num-kv-blocks", "512")
        self.processes: list[harness.Process] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            process = harness.dataplane(*self.args, name=f"dataplane{len(self.processes)}")
            self.processes.append(process)
            while process.popen.poll() is None and not self._stop.is_set():
                time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        for process in self.processes:
            process.stop()


def test_chaos_proxy_loses_and_duplicates_no_token(model, expected, tmp_path):
    upstream = f"tcp://127.0.0.1:{harness.free_port()}"
    listen = f"tcp://127.0.0.1:{harness.free_port()}"
    faults = Faults(drop=0.01, duplicate=0.05, delay=0.05, max_delay_s=0.05, corrupt=0.01, seed=7)
    server = harness.controlplane(model, tmp_path, upstream, "--reattach-timeout", "60")
    with ChaosProxyProcess(listen, upstream, faults, tmp_path / "chaos.json") as proxy:
        dataplanes = Restarting(model, tmp_path, listen)
        try:
            server.wait_serving()
            results = InFlight(server.client, max_tokens=MAX_TOKENS).wait()
            load = server.client.load()
            counts = proxy.counts()
        finally:
            dataplanes.stop()
            server.stop()
    assert [r[1] for r in results] == expected
    assert all(counts[k] > 0 for k in ("dropped", "duplicated", "delayed", "corrupted")), counts
    print(f"\nchaos: {counts}, data-plane losses {load.num_dataplane_losses}, "
          f"data planes started {len(dataplanes.processes)}")


def stops_cleanly(server) -> None:
    """The serve process exits 0 on its own after SIGTERM (its stacks are logged if not), and
    stops its data plane as a shutdown, not as a loss: SIGTERM, not SIGKILL, and no warning."""
    process = server.processes[0]
    exited = harness.wait_until(lambda: process.popen.poll() is not None, 30)
    if not exited:
        process.dump_stacks()
    server.stop()
    log = process.log()
    assert exited and process.popen.returncode == 0, log[-6000:]
    shutdown = log[log.index("draining:"):]
    assert " lost" not in shutdown and "killing" not in shutdown, shutdown
    assert "data plane exited on SIGTERM (code 0)" in shutdown, shutdown


def test_a_stopped_server_leaves_no_socket_directory(model, tmp_path, monkeypatch):
    """serve's private ipc:// directories (the data-plane link's, the front-end link's) go with
    it: each run left two /tmp/splitserve-* behind."""
    # (a short TMPDIR: a socket's path has room for ~107 bytes)
    with tempfile.TemporaryDirectory(prefix="ss") as tmp:
        monkeypatch.setenv("TMPDIR", tmp)
        server = harness.serve(model, tmp_path, "--num-kv-blocks", "64")
        made = list(pathlib.Path(tmp).glob("splitserve-*"))
        server.processes[0].popen.send_signal(signal.SIGTERM)
        stops_cleanly(server)
        assert len(made) == 2, made
        assert not list(pathlib.Path(tmp).glob("splitserve-*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_serve_starts_stops_what_started(model, tmp_path, monkeypatch, sig):
    """Ctrl-C (or SIGTERM) while serve waits for its front-end to start: it printed a
    KeyboardInterrupt traceback (SIGTERM: died on the spot) and left its socket directories.
    Now it stops what it started, says so, and exits 0."""
    with tempfile.TemporaryDirectory(prefix="ss") as tmp:
        monkeypatch.setenv("TMPDIR", tmp)
        process = harness.Process(["serve", "--model", str(model), "--port", "0",
                                   "--num-kv-blocks", "64"], tmp_path / "serve.log")
        try:
            # (the front-end's own start, its imports and its Hello, takes a few hundred ms)
            assert harness.wait_until(
                lambda: descendants_running(process.popen.pid, "frontend"), 60)
            children = harness.descendants(process.popen.pid)
            process.popen.send_signal(sig)
            code = process.popen.wait(30)
        finally:
            process.stop()
        log = process.log()
        assert code == 0 and "Traceback" not in log, log
        assert f"stopping on {sig.name}" in log, log
        assert not [pid for pid in children if harness.alive(pid)]
        assert not list(pathlib.Path(tmp).glob("splitserve-*"))


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_drains(model, tmp_path, to):
    """SIGTERM to the server, or to its whole process group (what dumb-init does in the
    container, and a Ctrl-C's SIGINT alike): the live streams finish through the front-end."""
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "512", "--drain-timeout", "30")
    flight = InFlight(server.client, max_tokens=300)
    assert flight.started.wait(60)
    if to == "group":
        os.killpg(server.processes[0].popen.pid, signal.SIGTERM)
    else:
        server.processes[0].popen.send_signal(signal.SIGTERM)
    # within 10 s: the health change goes engine -> front-end on two busy cores (it is ~50 ms
    # idle); streams that finish sooner end the server, which is not serving either
    assert harness.wait_until(lambda: not server.client.is_serving(), 10)
    with pytest.raises(grpc.RpcError) as error:
        server.client.generate([1, 2], max_tokens=2)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    results = flight.wait()
    assert [r[0] for r in results] == ["FINISH_REASON_LENGTH"] * len(PROMPTS)
    stops_cleanly(server)


def test_a_second_sigterm_ends_the_drain_at_once(model, tmp_path):
    """As vLLM's and uvicorn's second Ctrl-C: the drain stops waiting (it was ignored)."""
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "512", "--drain-timeout", "600")
    flight = InFlight(server.client, max_tokens=400)
    assert flight.started.wait(60)
    process = server.processes[0]
    process.popen.send_signal(signal.SIGTERM)
    process.wait_for_log("draining: ", 30)
    process.popen.send_signal(signal.SIGTERM)
    results = flight.wait()
    assert "UNAVAILABLE" in {r[0] for r in results}, results
    assert all("shutting down" in d for d in flight.details if d is not None), flight.details
    assert "a second signal: ending the" in process.log()
    stops_cleanly(server)


def test_sigterm_with_zero_drain_timeout_ends_live_requests_unavailable(model, tmp_path):
    server = harness.serve(model, tmp_path, "--num-kv-blocks", "512", "--drain-timeout", "0")
    flight = InFlight(server.client, max_tokens=400)
    assert flight.started.wait(60)
    server.processes[0].popen.send_signal(signal.SIGTERM)
    results = flight.wait()
    assert {r[0] for r in results} <= {"UNAVAILABLE", "FINISH_REASON_LENGTH"}
    assert "UNAVAILABLE" in {r[0] for r in results}
    assert all("shutting down" in d for d in flight.details if d is not None), flight.details
    stops_cleanly(server)
