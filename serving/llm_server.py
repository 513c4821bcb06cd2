"""LLMServer: one replica (replica group) owning one AsyncLLMEngine; the Ray Serve deployment wraps this class.

The constructor is synchronous and takes `engine_cls`, so it also runs without Ray (tests, the benchmark).
Under Ray Serve it reports engine gauges and step times to the ingress every `stats_interval_s`: replicas
are separate processes, and the ingress holds the one Prometheus registry of the pod.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import itertools
import logging
import math
import os
from typing import Any, AsyncIterator

from cpuserve.engine.errors import EngineDeadError
from cpuserve.engine.outputs import StepOutput
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.affinity import engine_cores, on_cores
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.engine_http import EngineHTTP, engine_http_port
from cpuserve.serving.engine_metrics import engine_metrics_port, serve_engine_metrics
from cpuserve.serving.names import APP_NAME, ENGINE_APP_NAME, INGRESS_DEPLOYMENT
from cpuserve.serving.pacing import paced
from cpuserve.serving.protocol import (RESOURCE_EXHAUSTED, UNAVAILABLE, Chunk, GenerateRequest, Logprob, Message,
                                       ModelInfo, ReplicaStats, RequestError, RoutingStats, TopLogprob, encode)
from cpuserve.serving.tools import MISTRAL, format_of, prepare_messages, template_knows_tools, tool_grammar

log = logging.getLogger(__name__)


class LLMServer:
    """Serves generate/tokenize/info for one model from one engine.

    Args:
        config: a ServeConfig or its dict.
        engine_cls: the engine class; anything with AsyncLLMEngine's from_config, generate, tokenizer,
            max_model_len, num_streams, stats, pop_step_times, check_health and shutdown. None: AsyncLLMEngine,
            imported here, in the replica: the process that builds the app (`cpuserve serve`, before Ray starts)
            then never loads torch (3-4 CPU-seconds of every cold start).
    """

    def __init__(self, config: dict[str, Any] | ServeConfig, engine_cls: type | None = None):
        self.config = config if isinstance(config, ServeConfig) else ServeConfig(**config)
        self.replica_id = f"{os.getpid()}"
        self._ids = itertools.count()
        self.num_queued_tokens = 0  # prompt tokens of admitted requests still waiting for their first token
        self._stats_task: asyncio.Task | None = None
        self._probe: asyncio.Task | None = None  # the health probe in flight: callers share it
        self._ingress = None
        options = self.config.engine_options()
        cores = None
        try:  # inside a Serve replica: find the ingress to report to (no handle cycle in the app graph)
            from ray import serve
            from ray.serve.handle import DeploymentHandle

            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
            # build_engine_app's replicas report to build_ingress_app's Ingress (made without the existence check
            # of serve.get_deployment_handle: the two applications deploy together)
            app = APP_NAME if ctx.app_name == ENGINE_APP_NAME else ctx.app_name
            self._ingress = DeploymentHandle(INGRESS_DEPLOYMENT, app)
        except Exception:  # not running under Serve: a replica group's ranks are the engine's own processes
            self._ingress = None
        local_rank = getattr(getattr(ctx, "rank", None), "local_rank", None) if self._ingress is not None else None
        if local_rank is not None and self.config.ranks_per_replica == 1:  # its rank on the node: its cores
            cores = engine_cores(local_rank, self.config.cpus_per_replica)
        if self._ingress is not None and self.config.ranks_per_replica > 1:
            from cpuserve.serving.rank_actors import RayLauncher

            options["launcher"] = RayLauncher(f"cpuserve-{self.replica_id}", self.config.cpus_per_rank,
                                              self.config.socket_resource)
        if engine_cls is None:
            from cpuserve.engine.async_engine import AsyncLLMEngine as engine_cls
        with on_cores(cores):  # the engine's thread (and its OpenMP workers) on the cores kept for it, if any
            self.engine = engine_cls.from_config(**options)
        self._http = None
        if (port := engine_http_port()) is not None:  # this replica's pod serves the OpenAI API itself
            self._http = EngineHTTP(self, self.config, port)
        self._engine_metrics = None
        if (port := engine_metrics_port()) is not None:  # this replica's pod is a model server of its own
            self._engine_metrics = serve_engine_metrics(self.engine, self.config.model_name, self.config.block_size,
                                                        self.config.host, port,
                                                        self._http.core if self._http is not None else None)
        self.tokenizer = self.engine.tokenizer
        template = getattr(self.tokenizer, "chat_template", None)  # stand-in engines' tokenizers may have none
        self.tool_format = format_of(template)
        self._knows_tools = template_knows_tools(template)

    # -- requests -------------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[bytes]:
        """What the ingress's handle streams: `messages`, each encoded for the wire (protocol.encode)."""
        async for message in self.messages(request):
            yield encode(message)

    async def messages(self, request: GenerateRequest) -> AsyncIterator[Message]:
        """The Messages of one request: its chunks as they come, or, once, the error that refuses or ends it. With
        n > 1 samples a message carries every sample's chunk that is ready, each with its index.

        Closing this generator early (client gone, deadline) aborts the request in the engine, which frees
        its KV blocks at the next step.
        """
        self._ensure_started()
        request_id = request.request_id or f"{self.replica_id}-{next(self._ids)}"
        if request.model not in (None, self.config.model_name):  # the router knew no better
            yield Message([], RequestError(f"model={request.model!r}: this replica serves {self.config.model_name!r} "
                                           "(the model is changing); retry in 1 s", "model", UNAVAILABLE, 1))
            return
        if request.n > 1:
            async for message in self._samples(request, request_id):
                yield message
            return
        try:
            async for chunk in self._stream(request, request_id):
                yield Message([chunk])
        except RequestError as e:
            yield Message([], e)

    async def _samples(self, request: GenerateRequest, request_id: str) -> AsyncIterator[Message]:
        """n samples of one prompt. The first runs its prefill alone; the others start once it produced a token,
        so the prefix cache hands them the prompt's KV blocks instead of computing them again."""
        def sample(i: int) -> AsyncIterator[Chunk]:
            return self._stream(request, f"{request_id}-{i}", index=i)

        streams = [sample(0)]
        try:
            first = await anext(streams[0])
        except RequestError as e:
            yield Message([], e)
            return
        yield Message([first])
        streams += [sample(i) for i in range(1, request.n)]
        ready: asyncio.Queue = asyncio.Queue()

        async def pump(stream: AsyncIterator[Chunk]) -> None:
            try:
                async for chunk in stream:
                    ready.put_nowait(chunk)
            except RequestError as e:
                ready.put_nowait(e)
            finally:
                ready.put_nowait(None)

        tasks = [asyncio.create_task(pump(s)) for s in streams]
        try:
            num_open = request.n
            while num_open:
                chunks, item = [], await ready.get()
                while True:  # every chunk that is ready goes out in this message
                    if item is None:
                        num_open -= 1
                    elif isinstance(item, RequestError):
                        yield Message(chunks, item)
                        return
                    else:
                        chunks.append(item)
                    if ready.empty():
                        break
                    item = ready.get_nowait()
                if chunks:
                    yield Message(chunks)
        finally:  # the client left, or all are done: cancelling a pump closes its stream, which aborts its request
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, request: GenerateRequest, request_id: str, index: int = 0) -> AsyncIterator[Chunk]:
        """One sample's chunks; RequestError when it is refused (before its first chunk) or its replica fails."""
        params = request.sampling
        try:
            if params.seed is not None and index:  # seeded samples still differ from each other
                params = dataclasses.replace(params, seed=params.seed + index)
            prompt = self._prompt(request)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt  # as the engine would
            num_tokens = len(ids)
            if request.tools:
                params = self._tool_sampling(request, params)
            if request.fill_context:  # OpenAI chat's default: fill the rest of the context
                params = copy.copy(params)
                params.max_tokens = max(1, self.engine.max_model_len - num_tokens)
            self._admit(num_tokens)
            try:
                # tokens that pile up while Ray sends the previous message (or within the stream interval) go out
                # as one message
                stream = paced(self.engine.generate(ids, params, request_id, priority=request.priority),
                               self._stream_interval)
                first = await anext(stream)
            finally:  # prefilled (or refused, or gone): no longer queued
                self.num_queued_tokens -= num_tokens
        except ValueError as e:  # InvalidRequest names the field: empty prompt, too long, bad token id, ...
            chat = request.messages is not None
            rename = {**request.rename, **({"prompt": "messages"} if chat else {})}
            raise RequestError.from_value_error(e, "messages" if chat else "prompt", rename=rename) from None
        except EngineDeadError as e:
            raise _unavailable(e) from None
        # the first chunk names the replica, so clients (and tests) can see where a request ran
        chunk = self._chunk(first, index)
        chunk.replica, chunk.model = self.replica_id, self.config.model_name  # and the model that serves it
        if request.echo:  # completions' echo: the prompt's text comes first
            chunk.text = self._prompt_text(prompt, params) + chunk.text
        yield chunk
        try:
            async for step in stream:
                yield self._chunk(step, index)
        except EngineDeadError as e:  # mid-stream (a rank died): end this stream with the error
            raise _unavailable(e) from None

    def _chunk(self, step: StepOutput, index: int) -> Chunk:
        """A StepOutput as the wire's Chunk; logprobs carry token texts (the ingress has no tokenizer)."""
        logprobs = None
        if step.logprobs is not None:
            text = self._token_text
            logprobs = [Logprob(lp.token_id, text(lp.token_id), lp.logprob,
                                [TopLogprob(t, text(t), p) for t, p in lp.top]) for lp in step.logprobs]
        return Chunk(step.new_token_ids, step.new_text, step.finish_reason if step.finished else None,
                     step.num_prompt_tokens, step.num_generated_tokens, step.num_cached_tokens, step.num_draft_tokens,
                     step.num_accepted_tokens, logprobs, step.queue_time, index)

    def _admit(self, num_tokens: int) -> None:
        """Queue a prompt of num_tokens, or refuse it when the replica's queue would pass max_queued_tokens."""
        limit, queued = self.config.queued_tokens_limit, self.num_queued_tokens
        if queued and queued + num_tokens > limit:
            retry_after = max(1, math.ceil(queued / self.config.prefill_tokens_per_s))
            raise RequestError(f"{queued} prompt tokens wait on this replica and this request has {num_tokens}: past "
                               f"max_queued_tokens={limit}; retry in {retry_after} s", None, RESOURCE_EXHAUSTED,
                               retry_after)
        self.num_queued_tokens += num_tokens

    def _stream_interval(self) -> float:
        """Seconds between two messages of a stream now: the config's floor, or the message budget shared out."""
        c = self.config
        shared = self.engine.num_streams / c.stream_messages_per_s if c.stream_messages_per_s else 0.0
        return max(c.stream_interval_ms / 1000, shared)

    def _prompt_text(self, prompt: str | list[int], params: SamplingParams) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=params.skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _tool_sampling(self, request: GenerateRequest, params: SamplingParams) -> SamplingParams:
        """A required or named tool call is enforced by a grammar of the model's own call format."""
        changes: dict[str, Any] = {}
        if self.tool_format == MISTRAL:
            changes["skip_special_tokens"] = False  # [TOOL_CALLS] is a special token: keep it to parse
        choice = request.tool_choice
        if choice is not None:
            token = self.tokenizer.token_to_id("[TOOL_CALLS]")
            spec = tool_grammar(self.tool_format, request.tools, choice.name, request.parallel_tool_calls,
                                token if token is not None and self.tokenizer.is_special(token) else None)
            changes["structured_output"] = {"kind": "grammar", "spec": spec}
            request.rename["structured_output"] = "tool_choice"
        return dataclasses.replace(params, **changes) if changes else params

    def _prompt(self, request: GenerateRequest) -> str | list[int]:
        if request.messages is not None:
            messages, tools = request.messages, request.tools or []
            if tools or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
                messages = prepare_messages(messages, tools, self._knows_tools)
            variables = {"tools": tools} if tools and self._knows_tools else {}
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **variables)
            except Exception as e:  # a template may reject a conversation (roles out of order, ...)
                raise RequestError(f"messages: the chat template rejected them: {e}", "messages") from None
            # the template writes BOS itself
            return self.tokenizer.encode(text, add_special_tokens=False)
        return request.prompt

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def info(self) -> ModelInfo:
        return self._info()

    def _info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(name=c.model_name, max_model_len=self.engine.max_model_len, weights=c.weights,
                         kv_cache=c.kv_cache, replicas=c.replicas, tool_format=self.tool_format)

    def record_routing_stats(self) -> dict[str, Any]:
        """What serving/router.py routes by (Serve polls it every request_routing_stats_period_s): the model, and the
        KV pool's tokens, which bound the prefixes this replica can hold."""
        kv_tokens = self.engine.stats().num_blocks * self.config.block_size
        return RoutingStats(model=self.config.model_name, kv_tokens=kv_tokens).to_dict()

    def stats(self) -> ReplicaStats:
        """Engine gauges plus the step times since the last call (what the ingress turns into metrics)."""
        s = self.engine.stats()
        return ReplicaStats(replica_id=self.replica_id, model=self._info(), num_running=s.num_running,
                            num_waiting=s.num_waiting, num_used_blocks=s.num_blocks - s.num_free_blocks,
                            num_blocks=s.num_blocks, num_preemptions=s.num_preemptions,
                            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                            step_times=self.engine.pop_step_times())

    # -- health ---------------------------------------------------------------------------------------------
    async def probe(self) -> str | None:
        """Why this replica cannot serve now, or None. Real work, bounded by health_timeout_s: an idle engine runs
        one greedy token through every rank; a busy one is healthy while its steps go on. Concurrent calls share
        one probe, so probes never pile up in the engine."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe(), context=contextvars.Context())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> str | None:
        timeout = self.config.health_timeout_s
        try:
            self._check_progress()
            if self.engine.num_streams:  # busy and stepping: its requests are the proof of work
                return None
            ids = self.tokenizer.encode("ok")
            stream = self.engine.generate(ids, SamplingParams(max_tokens=1, temperature=0),
                                          f"health-{self.replica_id}-{next(self._ids)}")
            await asyncio.wait_for(_consume(stream), timeout)  # a timeout cancels it: the request is aborted
        except EngineDeadError as e:
            return str(e)
        except asyncio.TimeoutError:
            return f"the engine produced no token in {timeout:g} s (health_timeout_s): a step is stalled"
        return None

    def _check_progress(self) -> None:
        """Raises EngineDeadError when the engine thread or a rank died, or a step has run past health_timeout_s."""
        self.engine.check_health()
        stalled, timeout = self.engine.seconds_without_progress(), self.config.health_timeout_s
        if stalled > timeout:
            raise EngineDeadError(f"the engine has made no progress for {stalled:.1f} s (health_timeout_s="
                                  f"{timeout:g}): a step is stalled")

    # -- Ray Serve hooks ----------------------------------------------------------------------------------
    async def check_health(self) -> None:
        # Serve calls this on every replica soon after start: a good place to start the stats loop
        self._ensure_started()
        # raises when the engine thread died, a rank of the group is down or a step stalled: Serve replaces the replica
        self._check_progress()

    def _ensure_started(self) -> None:
        """The stats loop and this pod's own HTTP API (if it names a port), on the replica's event loop."""
        if self._http is not None:
            self._http.start()
        if self._ingress is not None and self._stats_task is None:
            # in a context of its own: started from a request, it would inherit that request's Serve context, and
            # Serve cancels a cancelled request's calls still in flight (the report of that moment)
            self._stats_task = asyncio.get_running_loop().create_task(self._report_stats(),
                                                                      context=contextvars.Context())

    async def _report_stats(self) -> None:
        timeout = max(5.0, 4 * self.config.stats_interval_s)  # a report stuck in flight must not stop the next ones
        while True:
            try:
                await asyncio.wait_for(self._ingress.report_stats.remote(self.stats()), timeout)
            except (Exception, asyncio.CancelledError) as e:  # the ingress may be restarting: report again next time
                if asyncio.current_task().cancelling():  # this task itself is being stopped
                    raise
                log.debug("stats report failed: %r", e)
            await asyncio.sleep(self.config.stats_interval_s)

    def __del__(self) -> None:  # Serve calls this when it stops the replica: stops the rank actors too
        if getattr(self, "_http", None) is not None:
            self._http.stop()
        if getattr(self, "_engine_metrics", None) is not None:  # frees the port for the replica replacing this one
            self._engine_metrics.shutdown()
            self._engine_metrics.server_close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def _consume(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


def _unavailable(e: EngineDeadError) -> RequestError:
    """This replica cannot serve; Serve's health check restarts it (and its group), so a retry succeeds."""
    return RequestError(f"{e}; this replica restarts: retry the request", None, UNAVAILABLE)
