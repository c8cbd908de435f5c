"""TP=2 over gloo, two real processes: logits equal transformers' (and so TP=1's), for the dense
model and for Qwen3-MoE (each expert's intermediate dim split over the ranks, router replicated)."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.transport import free_tcp_port
from common.wire import unpack_i32
from tests.dataplane import tp_worker

ATOL = 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["untied", "odd_vocab"])
def test_tp2_logits_match_transformers(checkpoints, tmp_path, name):
    check_tp2_logits(checkpoints[name], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe", "moe_step2"])  # experts one tensor each / stacked
def test_tp2_moe_logits_match_transformers(moe_checkpoints, tmp_path, name):
    check_tp2_logits(moe_checkpoints[name], tmp_path)


def check_tp2_logits(path, tmp_path):
    out = tmp_path / "logits.pt"
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.dataplane.tp_worker", str(path),
                               str(rank), "2", init, str(out)]) for rank in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert codes == [0, 0]
    got = torch.load(out)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0, -1] for p in tp_worker.PROMPTS]
    torch.testing.assert_close(got["prefill"][0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["prefill"][1], ref[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["chunk"][0], ref[2], atol=ATOL, rtol=0)
    assert list(unpack_i32(got["sampled"])) == [int(ref[1].argmax())]


def test_rank0s_rendezvous_store_holds_its_port_before_any_follower_hears_of_it():
    """A port merely seen free could be taken before rank 0 binds it; the store's is bound
    from the start (nothing else can bind it) and followers reach it as a client."""
    import datetime
    import socket

    import torch.distributed as dist

    from dataplane.distributed import rendezvous_store
    store = rendezvous_store(2, timeout_s=10)
    assert store.port > 0
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    follower = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                             timeout=datetime.timedelta(seconds=10))
    follower.set("hello", "rank 1")
    assert store.get("hello") == b"rank 1"
