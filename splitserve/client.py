"""The Python client: what users import instead of raw stubs. `Client` is blocking,
`AsyncClient` is for asyncio; both stream `GenerateResponse` chunks or collect a `Completion`."""

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2, generation_pb2_grpc

SAMPLING_FIELDS = frozenset(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[generation_pb2.TokenLogprobs] = field(default_factory=list)
    num_chunks: int = 0  # stream messages received (the server may put several tokens in one)

    def add(self, chunk: generation_pb2.GenerateResponse) -> None:
        self.num_chunks += 1
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = finish_reason_name(chunk.finish_reason)
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens
            self.cached_tokens = chunk.usage.cached_tokens


def finish_reason_name(value: int) -> str:
    """The FinishReason enum's value as vLLM names a finish reason: "length", "stop", ..."""
    return generation_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def build_sampling(**sampling) -> generation_pb2.SamplingParams:
    """Takes the SamplingParams field names (max_tokens=..., stop=[...]); None is unset. A lone
    string as `stop` is one stop string, as vLLM's SamplingParams takes it (protobuf would make
    each of its characters one)."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return generation_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})


def build_request(prompt: str | Sequence[int], request_id: str = "", **sampling
                  ) -> generation_pb2.GenerateRequest:
    """`sampling` as build_sampling takes it."""
    request = generation_pb2.GenerateRequest(request_id=request_id,
                                             sampling=build_sampling(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _channel_args(address: str, tls: bool, root_certificates: bytes | None,
                  certificate_chain: bytes | None, private_key: bytes | None):
    credentials = None
    if tls:
        credentials = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    return address, credentials


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 certificate_chain: bytes | None = None, private_key: bytes | None = None) -> None:
        target, credentials = _channel_args(address, tls, root_certificates, certificate_chain,
                                            private_key)
        self.channel = grpc.secure_channel(target, credentials) if credentials else \
            grpc.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate_stream(self, prompt: str | Sequence[int], *, request_id: str = "",
                        timeout: float | None = None, **sampling
                        ) -> Iterator[generation_pb2.GenerateResponse]:
        """Stream chunks; cancelling the call (its cancel()) cancels the request on the
        server."""
        return self.stub.Generate(build_request(prompt, request_id, **sampling), timeout=timeout,
                                  metadata=self.metadata)

    def generate(self, prompt: str | Sequence[int], *, request_id: str = "",
                 timeout: float | None = None, **sampling) -> Completion:
        completion = Completion()
        for chunk in self.generate_stream(prompt, request_id=request_id, timeout=timeout, **sampling):
            completion.add(chunk)
        return completion

    def abort(self, *request_ids: str) -> int:
        request = generation_pb2.AbortRequest(request_ids=request_ids)
        return self.stub.Abort(request, metadata=self.metadata).num_aborted

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(generation_pb2.TokenizeRequest(text=text),
                                       metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=token_ids),
                                    metadata=self.metadata).text

    def model_info(self) -> generation_pb2.ModelInfo:
        return self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=self.metadata)

    def load(self) -> generation_pb2.Load:
        return self.stub.GetLoad(generation_pb2.GetLoadRequest(), metadata=self.metadata)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The service's status name (SERVING, NOT_SERVING); raises grpc.RpcError when the
        check itself fails (no server there: UNAVAILABLE; no such service: NOT_FOUND)."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                          timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def is_serving(self, service: str = "", timeout: float = 5.0) -> bool:
        try:
            return self.health(service, timeout) == "SERVING"
        except grpc.RpcError:
            return False

    def wait_until_serving(self, timeout: float) -> bool:
        """Poll health until SERVING (a data plane attached) or `timeout` seconds pass."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_serving(timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return True
            time.sleep(0.1)
        return False


class AsyncClient:
    def __init__(self, address: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 certificate_chain: bytes | None = None, private_key: bytes | None = None) -> None:
        target, credentials = _channel_args(address, tls, root_certificates, certificate_chain,
                                            private_key)
        self.channel = grpc.aio.secure_channel(target, credentials) if credentials else \
            grpc.aio.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def generate_stream(self, prompt: str | Sequence[int], *, request_id: str = "",
                        timeout: float | None = None, **sampling
                        ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, request_id, **sampling), timeout=timeout,
                                  metadata=self.metadata)

    async def generate(self, prompt: str | Sequence[int], *, request_id: str = "",
                       timeout: float | None = None, **sampling) -> Completion:
        completion = Completion()
        async for chunk in self.generate_stream(prompt, request_id=request_id, timeout=timeout,
                                                **sampling):
            completion.add(chunk)
        return completion

    async def abort(self, *request_ids: str) -> int:
        request = generation_pb2.AbortRequest(request_ids=request_ids)
        return (await self.stub.Abort(request, metadata=self.metadata)).num_aborted

    async def load(self) -> generation_pb2.Load:
        return await self.stub.GetLoad(generation_pb2.GetLoadRequest(), metadata=self.metadata)

    async def model_info(self) -> generation_pb2.ModelInfo:
        return await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                            metadata=self.metadata)

    async def tokenize(self, text: str) -> list[int]:
        response = await self.stub.Tokenize(generation_pb2.TokenizeRequest(text=text),
                                            metadata=self.metadata)
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        response = await self.stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=token_ids),
                                              metadata=self.metadata)
        return response.text

    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        """As Client.health."""
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def is_serving(self, service: str = "", timeout: float = 5.0) -> bool:
        try:
            return await self.health(service, timeout) == "SERVING"
        except grpc.RpcError:
            return False

    async def wait_until_serving(self, timeout: float) -> bool:
        """As Client.wait_until_serving."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self.is_serving(timeout=max(0.1, min(2.0, deadline - loop.time()))):
                return True
            await asyncio.sleep(0.1)
        return False
