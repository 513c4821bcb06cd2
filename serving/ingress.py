"""Ingress deployment: OpenAI-compatible HTTP and gRPC in one replica, routing to LLMServer replicas.

Per request: authorize -> parse and validate (errors name the field) -> admission (503 with Retry-After /
RESOURCE_EXHAUSTED past replicas x max_num_seqs running + max_queued_requests waiting; each replica refuses a prompt
that would pass its max_queued_tokens) -> stream from an LLMServer through a
DeploymentHandle (Ray's router picks the replica with fewer ongoing requests) -> record metrics.
Leaving a stream early (client gone, gRPC deadline) cancels the handle's response, which closes the
replica's generator and aborts the request in its engine.
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` annotation

import asyncio
import contextvars
import uuid
from typing import Any, AsyncIterator, Awaitable, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, start_http_server
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from cpuserve.serving import grpc_api
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.direct_grpc import DirectGRPC
from cpuserve.serving.direct_http import DirectHTTP, bind
from cpuserve.serving.metrics import build_serving_metrics
from cpuserve.serving.names import ENGINE_APP_NAME, SERVER_DEPLOYMENT
from cpuserve.serving.openai_api import ChatRequest, CompletionRequest, parse_body
from cpuserve.serving.openapi_doc import build_openapi
from cpuserve.serving.openai_responses import completion_body, error_event, error_response, sse, usage
from cpuserve.serving.protocol import (NOT_FOUND, RESOURCE_EXHAUSTED, TOO_LARGE, UNAUTHENTICATED, UNAVAILABLE, Chunk,
                                       GenerateRequest, ModelInfo, ReplicaStats, RequestError, decode, merge_samples,
                                       total)
from cpuserve.serving.ray_env import own_data_plane
from cpuserve.serving.telemetry import EngineStatsAggregator, RequestTimer
from cpuserve.serving.tool_stream import ToolCallStream
from cpuserve.serving.tools import parse_tool_calls
from cpuserve.v1 import inference_pb2 as pb

T = TypeVar("T")


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # unknown paths and methods answer in OpenAI's error shape too
    kind = NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
    body = RequestError(f"{request.method} {request.url.path}: {exc.detail}", None, kind).to_dict()
    return JSONResponse({"error": body}, status_code=exc.status_code, headers=exc.headers)  # 405's Allow


def bearer_token(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` value (the scheme in any case, RFC 7235), else None: a bare key
    without the scheme is refused, as OpenAI's API refuses it."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def _disconnected(request: Request, poll_s: float = 0.5) -> None:
    """Returns once the HTTP client has gone (its body is read by then: only the disconnect is left to receive)."""
    try:
        while not await request.is_disconnected():
            await asyncio.sleep(poll_s)
    except Exception:  # noqa: BLE001 (a server that cannot tell: never say gone)
        await asyncio.Event().wait()


async def _result(response: Any) -> Any:
    return await response


async def _merged(first: list[Chunk], stream: AsyncIterator[list[Chunk]]) -> list[Chunk]:
    """A non-streamed answer: the chunks of every message merged, per sample."""
    return merge_samples(first + [c async for chunks in stream for c in chunks])


class IngressCore:
    """Everything the ingress does, without Ray Serve's wrapper (`Ingress` below is the deployment).

    Args:
        config: a ServeConfig's dict.
        llm_server: a DeploymentHandle to LLMServer (tests pass a stand-in that calls an LLMServer in-process).
        knows_model: whether the config names the replicas' model; False for the Ingress of build_ingress_app,
            which learns it from the replicas' reports.

    The model is the replicas': each reports its model with its stats, so while a model change rolls, requests
    naming either model are served (by a replica serving it: serving/router.py) and /v1/models lists both.
    """

    def __init__(self, config: dict[str, Any], llm_server: Any, knows_model: bool = True):
        self.config = ServeConfig(**config)
        self.llm = llm_server
        self.api_keys = self.config.api_keys()
        self.metrics = build_serving_metrics(registry := CollectorRegistry())
        self.registry = registry
        self.engine_stats = EngineStatsAggregator(self.metrics, self.config.model_name if knows_model else None)
        if self.config.metrics_port:
            try:
                start_http_server(self.config.metrics_port, addr=self.config.host, registry=registry)
            except OSError as e:  # Serve reports only that the Ingress failed: name the field here
                port = self.config.metrics_port
                raise RuntimeError(f"metrics_port={port}: cannot bind {self.config.host}:{port} ({e.strerror}); "
                                   "choose a free port, or 0 for none") from e
        c = self.config
        self.max_in_flight = c.replicas * c.max_num_seqs + c.max_queued_requests
        self.num_in_flight = 0
        self.draining = False
        self.openapi_doc = build_openapi(c.max_request_bytes, bool(self.api_keys))
        self._health: asyncio.Task | None = None  # the health probe in flight: /health and gRPC Health share it

    @property
    def model(self) -> str:
        """The name of the model most recently reported (before any report: the config's)."""
        return next(iter(self.engine_stats.models()), self.config.model_name)

    async def _served(self) -> dict[str, ModelInfo]:
        """name -> info of the models the replicas serve (asked of one replica before any report)."""
        models = self.engine_stats.models()
        if not models:
            info = await self.llm.info.remote()
            models = {info.name: info}
        return models

    # -- the request path shared by HTTP and gRPC ----------------------------------------------------------
    async def _run(self, model: str | None, request: GenerateRequest) -> AsyncIterator[list[Chunk]]:
        """The chunks of one request, a streamed message's at a time; raises RequestError before the first message
        if it is refused, and at the message that ends the stream with an error."""
        served = await self._served()
        if model and model not in served:
            raise RequestError(f"model={model!r} is not served here; available: {sorted(served)!r}", "model",
                               NOT_FOUND)
        request.model = model or None  # the router sends a request naming a model to a replica serving it
        label = model or next(iter(served))
        if self.draining:
            raise RequestError("the server is shutting down: running requests finish, new ones go elsewhere", None,
                               UNAVAILABLE)
        if self.num_in_flight >= self.max_in_flight:
            self.metrics.refused.labels(model=label, limit="requests").inc()
            raise RequestError(f"{self.num_in_flight} requests are running or waiting, the limit (replicas x "
                               "max_num_seqs + max_queued_requests): retry in 1 s", None, RESOURCE_EXHAUSTED, 1)
        self.num_in_flight += 1
        timer = RequestTimer(self.engine_stats.request_metrics, label)
        # the replica sends protocol.encode's bytes: plain pickle wraps them (Ray's default, cloudpickle, costs more)
        responses = self.llm.options(stream=True, request_serialization="pickle",
                                     response_serialization="pickle").generate.remote(request)
        reason = "abort"  # unless the stream says otherwise: the client left or the deadline passed
        try:
            async for data in responses:
                message = decode(data)
                for chunk in message.chunks:
                    timer.on_chunk(chunk)
                    reason = chunk.finish_reason or reason
                if message.error is not None:
                    error = message.error
                    timer.finished = error.kind != UNAVAILABLE  # refused requests are not served requests
                    if error.kind == RESOURCE_EXHAUSTED:  # the replica's queue of prompt tokens is full
                        self.metrics.refused.labels(model=label, limit="tokens").inc()
                    reason = "error"
                    if message.chunks:  # what came before the error still goes out
                        yield message.chunks
                    raise error
                yield message.chunks
        except BackPressureError as e:
            timer.finished = True
            self.metrics.refused.labels(model=label, limit="requests").inc()
            raise RequestError(f"overloaded: {e}", None, RESOURCE_EXHAUSTED, 1) from None
        except RayActorError as e:  # its process died (killed, out of memory): Serve starts another
            reason = "error"
            raise RequestError(f"the LLMServer replica serving this request is gone ({type(e).__name__}); Serve "
                               "starts another: retry the request", None, UNAVAILABLE) from None
        except DeploymentUnavailableError as e:
            reason = "error"
            raise RequestError(f"no LLMServer replica is available ({e}): retry the request", None,
                               UNAVAILABLE) from None
        finally:
            self.num_in_flight -= 1
            responses.cancel()  # a no-op once finished; otherwise aborts the request on its replica
            timer.finish(reason)

    async def _start(self, model: str | None, request: GenerateRequest):
        if request.request_id is None:
            request.request_id = uuid.uuid4().hex[:16]
        stream = self._run(model, request)
        first = await anext(stream)  # RequestError here: nothing was sent to the client yet
        return request.request_id, first, stream

    async def _unless_gone(self, request: Request, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None once the HTTP client has left first (noticed within 0.5 s): `work` is cancelled,
        so the request it waits on is aborted on its replica and counted aborted. A queued request would otherwise
        keep its place and get its prompt prefilled for nobody, and a non-streamed one would run to max_tokens. Serve's
        HTTP proxy cancels the handler itself when its client leaves; the Ingress's own server (direct_http) does
        not. (gRPC needs none of this: grpc.aio cancels the handler when its client goes.)"""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():  # cancelled here, its stream's cleanup aborts the request and counts it aborted
                task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this handler itself is being cancelled
                raise
            return None

    async def drain(self, refuse: bool = True) -> int:
        """From now on refuse new requests (503 / UNAVAILABLE) and fail /health; returns the requests in flight,
        which run to their end. `cpuserve serve` calls this on SIGTERM, `cpuserve drain` in the head pod's preStop.
        refuse=False only counts them (a rank pod's preStop waits for them while the head drains)."""
        self.draining = self.draining or refuse
        return self.num_in_flight

    async def report_stats(self, stats: ReplicaStats) -> None:
        """Each LLMServer replica calls this every stats_interval_s."""
        self.engine_stats.update(stats)

    async def _model_info(self, name: str | None = None) -> ModelInfo:
        """The info of model `name`, or of the model most recently reported."""
        served = await self._served()
        return served.get(name) or next(iter(served.values()))

    async def _models(self) -> list[ModelInfo]:
        return [await self._model_info(name) for name in await self._served()]

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _authorize_http(self, request: Request) -> None:
        if self.api_keys and bearer_token(request.headers.get("authorization", "")) not in self.api_keys:
            raise RequestError("missing or unknown API key: send Authorization: Bearer <key>", None, UNAUTHENTICATED)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length")
        if length and length.isascii() and length.isdigit() and int(length) > limit:
            raise RequestError(f"body is {length} bytes; the limit is {limit}", "body", TOO_LARGE)
        body = bytearray()
        async for part in request.stream():  # chunked uploads: stop reading past the limit
            body += part
            if len(body) > limit:
                raise RequestError(f"body exceeds the limit of {limit} bytes", "body", TOO_LARGE)
        return bytes(body)

    async def _openai(self, request: Request, cls: type, chat: bool) -> Response:
        try:
            self._authorize_http(request)
            parsed = parse_body(await self._read_body(request), cls)
            internal = parsed.to_internal()
            started = await self._unless_gone(request, self._start(parsed.model, internal))
        except RequestError as e:
            return error_response(e)
        if started is None:  # nobody is there to read an answer
            return Response(status_code=499)
        rid, first, stream = started
        rid = ("chatcmpl-" if chat else "cmpl-") + rid
        headers = {"x-cpuserve-replica": first[0].replica}
        model = first[0].model or self.model  # the model that serves it
        tool_format = (await self._model_info(model)).tool_format if internal.tools else None
        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
        if parsed.stream:  # with tools, calls stream as the model writes them
            tools = ToolCallStream(tool_format) if tool_format else None
            return StreamingResponse(self._sse(rid, model, first, stream, chat, include_usage, tools, n=parsed.n),
                                     media_type="text/event-stream", headers=headers)
        try:
            samples = await self._unless_gone(request, _merged(first, stream))
        except RequestError as e:
            return error_response(e)
        if samples is None:
            return Response(status_code=499)
        if len(samples) > 1:  # n samples: one choice each
            body = completion_body(rid, model, samples[0], chat, final=True)
            body["choices"] = [completion_body(rid, model, m, chat, final=True)["choices"][0] for m in samples]
            body["usage"] = usage(total(samples))
            return JSONResponse(body, headers=headers)
        merged, calls = samples[0], None
        if tool_format:
            text, calls = parse_tool_calls(tool_format, merged.text)
            merged = msgspec.structs.replace(merged, text=text)  # None when the answer is only calls
        return JSONResponse(completion_body(rid, model, merged, chat, final=True, tool_calls=calls),
                            headers=headers)

    async def _sse(self, rid: str, model: str, first: list[Chunk], stream: AsyncIterator[list[Chunk]], chat: bool,
                   include_usage: bool, tools: ToolCallStream | None = None, n: int = 1) -> AsyncIterator[bytes]:
        """One write per streamed message: the events of its chunks (every sample's that was ready) together."""
        chunks, text_offsets, last = first, [0] * n, {}  # per sample index: where its text is, its latest chunk
        try:
            while True:
                events = []
                for chunk in chunks:
                    deltas = None
                    if tools is not None:
                        chunk, deltas = tools.apply(chunk)
                    events.append(sse(completion_body(rid, model, chunk, chat, final=False,
                                                      text_offset=text_offsets[chunk.index], tool_calls=deltas)))
                    last[chunk.index] = chunk
                    text_offsets[chunk.index] += len(chunk.text)
                done = len(last) == n and all(c.finish_reason is not None for c in last.values())
                if done and include_usage:
                    events.append(sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                       "model": model, "choices": [], "usage": usage(total(list(last.values())))}))
                if done:
                    events.append(sse("[DONE]"))
                yield b"".join(events)
                if done:
                    break
                chunks = await anext(stream)
        except RequestError as e:  # after the 200 header: report in-stream, as OpenAI does
            yield error_event(e)
        finally:
            await stream.aclose()

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, ChatRequest, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize_http(request)
        except RequestError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": info.name, "object": "model", "created": 0, "owned_by": "cpuserve",
             "max_model_len": info.max_model_len} for info in await self._models()]})

    async def openapi(self) -> Response:
        return JSONResponse(self.openapi_doc)

    async def health(self) -> Response:
        ok, message = await self._is_healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable", "message": message},
                            status_code=200 if ok else 503)

    async def _is_healthy(self) -> tuple[bool, str]:
        """A replica's probe (LLMServer.probe: real work, bounded); concurrent health requests share one probe."""
        if self.draining:
            return False, f"shutting down: {self.num_in_flight} request(s) finishing"
        if self._health is None or self._health.done():
            self._health = asyncio.get_running_loop().create_task(self._probe(), context=contextvars.Context())
        return await asyncio.shield(self._health)

    async def _probe(self) -> tuple[bool, str]:
        timeout = self.config.health_timeout_s + 5  # the replica's own bound, and the hop to it
        response = self.llm.probe.remote()
        try:
            reason = await asyncio.wait_for(_result(response), timeout)
        except asyncio.TimeoutError:
            response.cancel()
            return False, f"no LLMServer replica answered the health probe within {timeout:g} s"
        except Exception as e:  # noqa: BLE001 (any failure means not serving)
            return False, f"no LLMServer replica answers: {e!r}"[:500]
        return (False, reason) if reason else (True, f"serving {self.model}")

    # -- gRPC (method names are the rpc names; requests arrive as raw bytes, see grpc_api) ------------------
    def _grpc_fail(self, context: Any, e: RequestError) -> None:
        context.set_code(grpc_api.status_code(e))
        context.set_details(e.message)
        if e.retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
        raise e

    def _authorize_grpc(self, context: Any) -> None:
        if not self.api_keys:
            return
        metadata = dict(context.invocation_metadata())
        if bearer_token(metadata.get("authorization", "")) not in self.api_keys:
            raise RequestError("missing or unknown API key: send authorization: Bearer <key> metadata", None,
                               UNAUTHENTICATED)

    async def _grpc_start(self, request: bytes, grpc_context: Any):
        try:
            self._authorize_grpc(grpc_context)
            model, internal = grpc_api.generate_request(grpc_api.parse(request, pb.GenerateRequest),
                                                        self.config.max_request_bytes)
            rid, first, stream = await self._start(model, internal)
            tool_format = (await self._model_info(first[0].model)).tool_format if internal.tools else None
            return rid, first, stream, tool_format
        except RequestError as e:
            self._grpc_fail(grpc_context, e)

    async def Generate(self, request: bytes, grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        rid, chunks, stream, tool_format = await self._grpc_start(request, grpc_context)
        tools = ToolCallStream(tool_format) if tool_format else None  # calls stream in pieces as written
        try:
            while chunks is not None:
                for chunk in chunks:
                    deltas = None
                    if tools is not None:
                        chunk, deltas = tools.apply(chunk)
                    yield grpc_api.generate_response(rid, chunk, deltas)
                chunks = await anext(stream, None)
        except RequestError as e:
            self._grpc_fail(grpc_context, e)
        finally:
            await stream.aclose()

    async def Complete(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        rid, first, stream, tool_format = await self._grpc_start(request, grpc_context)
        try:
            samples = merge_samples(first + [c async for chunks in stream for c in chunks])
        except RequestError as e:
            self._grpc_fail(grpc_context, e)
        if tool_format:
            samples[0], calls = grpc_api.split_tool_calls(samples[0], tool_format)
            return grpc_api.complete_response(rid, samples, calls)
        return grpc_api.complete_response(rid, samples)

    async def Tokenize(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        try:
            self._authorize_grpc(grpc_context)
            req = grpc_api.parse(request, pb.TokenizeRequest)
            served = await self._served()
            if req.model and req.model not in served:
                raise RequestError(f"model={req.model!r} is not served here; available: {sorted(served)!r}", "model",
                                   NOT_FOUND)
        except RequestError as e:
            self._grpc_fail(grpc_context, e)
        ids = await self.llm.tokenize.remote(req.text, req.add_special_tokens)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=(await self._model_info(req.model)).max_model_len)

    async def ListModels(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        try:
            self._authorize_grpc(grpc_context)
            grpc_api.parse(request, pb.ListModelsRequest)  # bytes that are no message: INVALID_ARGUMENT, as elsewhere
        except RequestError as e:
            self._grpc_fail(grpc_context, e)
        return pb.ListModelsResponse(models=[pb.ModelInfo(**msgspec.structs.asdict(info))
                                             for info in await self._models()])

    async def Health(self, request: bytes, grpc_context: Any) -> Any:  # noqa: N802
        try:
            grpc_api.parse(request, pb.HealthRequest)
        except RequestError as e:
            self._grpc_fail(grpc_context, e)
        ok, message = await self._is_healthy()
        status = pb.SERVING_STATUS_SERVING if ok else pb.SERVING_STATUS_NOT_SERVING
        return pb.HealthResponse(status=status, message=message)


# (method, path, IngressCore's method): the HTTP API, declared once for both apps that serve it (build_api)
ROUTES = (("POST", "/v1/completions", "completions"), ("POST", "/v1/chat/completions", "chat_completions"),
          ("GET", "/v1/models", "models"), ("GET", "/openapi.json", "openapi"), ("GET", "/health", "health"))


def build_api(core: IngressCore | None = None) -> FastAPI:
    """The FastAPI app of ROUTES. Without `core`, its routes are IngressCore's functions and Ray Serve's
    @serve.ingress binds them to the Ingress replica (`api` below); with it, to `core`'s own methods, for an app
    served outside Serve's ingress (an LLMServer replica's own port: serving/engine_http.py)."""
    app = FastAPI(title="cpuserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(HTTPException, _http_error)
    for method, path, name in ROUTES:
        app.add_api_route(path, getattr(IngressCore if core is None else core, name), methods=[method])
    return app


api = build_api()


@serve.ingress(api)
class Ingress(IngressCore):
    """The Ingress deployment: Ray Serve binds `api`'s routes (IngressCore's methods) to the replica."""

    def __init__(self, config: dict[str, Any], llm_server: Any):
        lone = llm_server is None  # build_ingress_app: the LLMServer replicas are another application's
        if lone:  # made here, not by serve.get_deployment_handle, which fails while that application deploys
            llm_server = DeploymentHandle(SERVER_DEPLOYMENT, ENGINE_APP_NAME)
        super().__init__(config, own_data_plane(llm_server), knows_model=not lone)
        c, loop = self.config, asyncio.get_running_loop()
        self.direct_http = self.direct_grpc = None
        # bound now: a port in use fails the replica's start, naming the port
        if c.direct_http:
            self.direct_http = DirectHTTP(bind(c.host, c.http_port), c.tls_cert_file, c.tls_key_file, c.access_log)
            # Serve's wrapper sets the app (`self.app`) right after this constructor returns
            loop.call_soon(lambda: self.direct_http.start(self.app))
        if c.direct_grpc:
            self.direct_grpc = DirectGRPC(self, c.host, c.grpc_port, 2 * c.max_request_bytes)
            loop.create_task(self.direct_grpc.start())

    def __del__(self):
        if getattr(self, "direct_http", None) is not None:
            self.direct_http.stop()

