"""Bearer tokens on every method but health; TLS and mutual TLS."""

import subprocess

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import generation_pb2
from splitserve.client import Client
from tests.integration import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "s3cret-key-for-tests"


def calls(client: Client):
    """Every non-health method, as zero-argument callables."""
    stub = client.stub
    md = client.metadata
    reflection = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    return {
        "Generate": lambda: list(stub.Generate(generation_pb2.GenerateRequest(text="hi"), metadata=md)),
        "Abort": lambda: stub.Abort(generation_pb2.AbortRequest(request_ids=["x"]), metadata=md),
        "Tokenize": lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), metadata=md),
        "Detokenize": lambda: stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[1]), metadata=md),
        "GetModelInfo": lambda: stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=md),
        "GetLoad": lambda: stub.GetLoad(generation_pb2.GetLoadRequest(), metadata=md),
        "Reflection": lambda: list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=md)),
    }


@pytest.fixture(scope="module")
def authed(checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "keys"
    keys.write_text(f"# comment\nother-key\n{KEY}\n")
    process = harness.Process(["serve", "--model", str(checkpoints["untied"]), "--port", "0",
                               "--num-kv-blocks", "64", "--api-key-file", str(keys)], tmp / "serve.log")
    port = int(process.wait_for_log(r"serving gRPC on [\d.]+:(\d+)").group(1))
    server = harness.Server([process], port).wait_serving()  # health needs no key
    yield server
    server.stop()


@pytest.mark.parametrize("token", [None, "wrong", KEY + "x"])
def test_every_method_but_health_refuses_a_missing_or_wrong_key(authed, token):
    with Client(authed.address, api_key=token) as client:
        assert client.is_serving()
        for name, call in calls(client).items():
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, name


def test_the_right_key_opens_every_method(authed):
    with Client(authed.address, api_key=KEY) as client:
        for name, call in calls(client).items():
            call()
        assert client.generate([1, 2], ignore_eos=True, max_tokens=2).completion_tokens == 2


def make_pki(directory):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        (directory / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {p.stem + p.suffix: p.read_bytes() for p in directory.iterdir()}


def tls_server(model, tmp, *extra):
    process = harness.Process(["serve", "--model", str(model), "--port", "0", "--num-kv-blocks", "64",
                               "--tls-cert", str(tmp / "server.pem"), "--tls-key",
                               str(tmp / "server.key"), *extra], tmp / "serve.log")
    port = int(process.wait_for_log(r"serving gRPC on [\d.]+:(\d+)").group(1))
    return process, f"127.0.0.1:{port}"


def test_tls_refuses_plaintext(checkpoints, tmp_path):
    pki = make_pki(tmp_path)
    process, address = tls_server(checkpoints["untied"], tmp_path)
    try:
        with Client(address, tls=True, root_certificates=pki["ca.pem"]) as client:
            assert client.wait_until_serving(60)
            assert client.generate([1, 2], ignore_eos=True, max_tokens=2).completion_tokens == 2
        with Client(address) as plaintext:
            with pytest.raises(grpc.RpcError) as error:
                plaintext.tokenize("hi")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        process.stop()


def test_mutual_tls_requires_a_client_certificate(checkpoints, tmp_path):
    pki = make_pki(tmp_path)
    process, address = tls_server(checkpoints["untied"], tmp_path, "--tls-client-ca",
                                  str(tmp_path / "ca.pem"))
    try:
        with Client(address, tls=True, root_certificates=pki["ca.pem"],
                    certificate_chain=pki["client.pem"], private_key=pki["client.key"]) as client:
            assert client.wait_until_serving(60)
            assert client.generate([1, 2], ignore_eos=True, max_tokens=2).completion_tokens == 2
        with Client(address, tls=True, root_certificates=pki["ca.pem"]) as anonymous:
            with pytest.raises(grpc.RpcError) as error:
                anonymous.tokenize("hi")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        process.stop()
