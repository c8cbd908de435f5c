"""The gRPC servicer: translates protos to engine calls and back; decides nothing itself."""

import dataclasses
import time
import uuid

import grpc

from common.model_info import ModelInfo
from controlplane.engine import Engine, NotAccepting
from controlplane.streams import Chunk, RequestStream
from controlplane.request import FinishReason, Request
from controlplane.validation import Limits, ValidationError, sampling_params, validate_prompt, \
    validate_request_id
from protos import generation_pb2, generation_pb2_grpc

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: generation_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}
# Reasons that end the stream with an error status instead of a last chunk.
_ERROR_STATUS = {
    FinishReason.ERROR: (grpc.StatusCode.INTERNAL, "the request failed in the engine"),
    FinishReason.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, "the data plane was lost and none "
                               "came back in time"),
    FinishReason.SHUTDOWN: (grpc.StatusCode.UNAVAILABLE, "the server is shutting down and the "
                            "request did not finish within its drain timeout"),
}


def chunk_to_proto(request_id: str, chunk: Chunk) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids,
                                               text=chunk.text)
    for lp in chunk.logprobs:
        response.logprobs.append(generation_pb2.TokenLogprobs(
            logprob=lp.logprob,
            top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    if chunk.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[chunk.finish_reason]
        response.usage.CopyFrom(generation_pb2.Usage(
            prompt_tokens=chunk.num_prompt_tokens, completion_tokens=chunk.num_output_tokens,
            cached_tokens=chunk.num_cached_tokens))
    return response


def chunk_replies(request_id: str, chunk: Chunk) -> tuple[
        generation_pb2.GenerateResponse | None, tuple[grpc.StatusCode, str] | None]:
    """What a stream's chunk becomes: the response to send (None: nothing) and, when the
    request failed, the status that ends the call (its tokens before the failure still go out,
    in a response without a finish reason)."""
    error = _ERROR_STATUS.get(chunk.finish_reason)
    if error is None:
        return chunk_to_proto(request_id, chunk), None
    if not chunk.token_ids:
        return None, error
    return chunk_to_proto(request_id, dataclasses.replace(chunk, finish_reason=None)), error


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, model: ModelInfo, max_model_len: int,
                 max_waiting_requests: int, max_logprobs: int) -> None:
        self.engine = engine
        self.model = model
        self.max_model_len = max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_logprobs = max_logprobs

    def limits(self) -> Limits:
        info = self.engine.info
        capacity = info.num_kv_blocks * info.block_size if info else self.max_model_len
        return Limits(max_model_len=self.max_model_len, vocab_size=self.model.vocab_size,
                      max_total_tokens=min(capacity, self.max_model_len),
                      max_logprobs=self.max_logprobs)

    async def _prompt(self, request: generation_pb2.GenerateRequest, limits: Limits) -> list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise ValidationError("input", "set text or token_ids")
        if which == "text":
            if not request.text:
                raise ValidationError("input.text", "the prompt is empty (0 characters)")
            ids = await self.engine.tokenizer.encode_off_loop(request.text)
            validate_prompt(ids, "input.text", limits, is_unsigned=True)
        else:
            ids = request.token_ids.ids[:]  # (a list; a third faster than list() of it)
            validate_prompt(ids, "input.token_ids.ids", limits, is_unsigned=True)
        return ids

    async def open_stream(self, request: generation_pb2.GenerateRequest,
                          context: grpc.aio.ServicerContext) -> tuple[str, RequestStream]:
        """Generate's start: the request checked and added to the engine. Returns its id and
        stream; ends the call through `context.abort` when it is refused."""
        if not self.engine.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining" if
                                self.engine.draining else "no data plane is attached")
        await self._refuse_beyond_the_queue_bound(context)
        limits = self.limits()
        try:
            validate_request_id(request.request_id, limits)
            prompt = await self._prompt(request, limits)
            params = sampling_params(request.sampling, len(prompt), limits)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._refuse_beyond_the_queue_bound(context)  # others came while it tokenized
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.engine.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {request_id!r} is already in use by a live request")
        try:
            stream = self.engine.add_request(Request(request_id, prompt, params,
                                                     self.model.eos_token_ids))
        except NotAccepting as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return request_id, stream

    async def _refuse_beyond_the_queue_bound(self, context: grpc.aio.ServicerContext) -> None:
        num_queued = self.engine.num_queued(num_new=1)  # with this request
        if num_queued > self.max_waiting_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.engine.load()[1]} requests are waiting, {num_queued} with "
                                f"this one beyond the free sequence slots (--max-num-seqs) and KV "
                                f"cache; the limit (--max-waiting-requests) is "
                                f"{self.max_waiting_requests}; retry later")

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id, stream = await self.open_stream(request, context)
        done = False
        try:
            async for chunk in stream:
                response, error = chunk_replies(request_id, chunk)
                done = error is not None
                if response is not None:
                    yield response
                if error is not None:
                    await context.abort(*error)
            done = True
        finally:
            if not done:  # the client cancelled, dropped the stream or its deadline passed
                self.close_stream(request_id, stream)

    def close_stream(self, request_id: str, stream: RequestStream) -> None:
        """The call of `stream` went away before its end: abort its request, if that is still
        the live request of this id (a new call may have taken a client-chosen id since)."""
        if self.engine.streams.get(request_id) is stream:
            self.engine.abort(request_id)

    async def Abort(self, request: generation_pb2.AbortRequest, context) -> generation_pb2.AbortResponse:
        num = sum(self.engine.abort(request_id) for request_id in set(request.request_ids))
        return generation_pb2.AbortResponse(num_aborted=num)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context
                       ) -> generation_pb2.TokenizeResponse:
        return generation_pb2.TokenizeResponse(
            token_ids=await self.engine.tokenizer.encode_off_loop(request.text))

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest, context
                         ) -> generation_pb2.DetokenizeResponse:
        vocab_size = self.model.vocab_size
        token_ids = request.token_ids[:]
        if token_ids and max(token_ids) >= vocab_size:  # (max: the loop below runs in Python)
            i, token = next((i, t) for i, t in enumerate(token_ids) if t >= vocab_size)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids[{i}]: token id {token} is outside the vocabulary "
                                f"[0, {vocab_size})")
        return generation_pb2.DetokenizeResponse(
            text=await self.engine.tokenizer.decode_off_loop(token_ids))

    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        info = self.engine.info
        # what only an attached data plane knows stays at proto3's zero values until one is
        attached = {} if info is None else dict(
            block_size=info.block_size, tp_size=info.tp_size, dtype=info.dtype,
            attention_backend=info.attention_backend)
        return generation_pb2.ModelInfo(model_name=self.model.name,
                                        max_model_len=self.max_model_len,
                                        vocab_size=self.model.vocab_size, **attached)

    async def GetLoad(self, request, context) -> generation_pb2.Load:
        running, waiting, used, total = self.engine.load()
        times = self.engine.step_times
        return generation_pb2.Load(num_running=running, num_waiting=waiting,
                                   kv_blocks_used=used, kv_blocks_total=total,
                                   num_preemptions=self.engine.num_preemptions,
                                   num_dataplane_losses=self.engine.num_dataplane_losses,
                                   num_steps=self.engine.num_steps,
                                   link_bytes_sent=getattr(self.engine.dataplane, "bytes_sent", 0),
                                   link_bytes_received=getattr(self.engine.dataplane,
                                                               "bytes_received", 0),
                                   control_plane_cpu_seconds=time.process_time(),
                                   num_prompt_steps=times.prompt.num_steps,
                                   prompt_step_host_seconds=times.prompt.host_s,
                                   prompt_step_total_seconds=times.prompt.total_s,
                                   prompt_step_device_idle_seconds=times.prompt.device_idle_s,
                                   decode_step_host_seconds=times.decode.host_s,
                                   decode_step_total_seconds=times.decode.total_s,
                                   decode_step_device_idle_seconds=times.decode.device_idle_s,
                                   prompt_step_device_seconds=times.prompt.device_s,
                                   decode_step_device_seconds=times.decode.device_s)
