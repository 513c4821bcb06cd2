"""LLMRouter: how the Ingress's DeploymentHandle picks an LLMServer replica, through Ray Serve's request-router
extension point (`ray.serve.request_router.RequestRouter`, set as the deployment's request_router_config).

1. Model: a request that names a model goes only to replicas serving it. During a model change both the old
   and the new replicas run; each reports its model in its routing stats (LLMServer.record_routing_stats).
2. Prefix affinity: a request whose prompt starts like one routed before goes to the replica it went to, whose
   KV cache then holds that prefix, unless that replica has more than `imbalance` requests more than the least
   busy one. Any other request is routed as Serve's default router does (power of two choices: the less busy of
   two random replicas), so traffic without shared prefixes is balanced exactly as without this router.

    prompt (token ids | text | chat messages)
      -> full chunks of CHUNK_TOKENS tokens (text: CHUNK_TOKENS x CHARS_PER_TOKEN characters)
      -> hash chain h1 = hash(0, c1), h2 = hash(h1, c2), ...      (as the engine hashes its KV blocks)
    per replica: an LRU set of the hashes routed to it, bounded by 4x its KV pool (protocol.RoutingStats.kv_tokens)
    match(replica) = how many of h1, h2, ... it holds, from the start

The index is what this router sent, not what each engine still caches: a prefix the engine evicted still counts
until the LRU drops it. It lives in the process that holds the handle (the one Ingress replica).
"""
from __future__ import annotations

import json
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cpuserve.serving.protocol import GenerateRequest, RoutingStats

CHUNK_TOKENS = 64
CHARS_PER_TOKEN = 4  # text prompts are chunked before tokenization (the ingress has no tokenizer)
UNBOUNDED_CHUNKS = 1 << 20  # a replica that has not reported its KV pool yet
# The index keeps this many times a replica's KV pool: a text chunk may hold fewer tokens than CHUNK_TOKENS (long
# words), and a prefix the engine has evicted is best sent back to the same replica, which caches it again.
INDEX_OVER_KV = 4


def prefix_chain(request: GenerateRequest) -> list[int]:
    """The hash chain of a request's prompt over its full chunks (empty when shorter than one chunk)."""
    if request.messages is not None:  # the chat template is applied in the replica: hash what decides the prompt
        prompt: str | list[int] = json.dumps(request.tools or [], sort_keys=True) + "".join(
            json.dumps(m, sort_keys=True) for m in request.messages)
    else:
        prompt = request.prompt or ""
    unit = CHUNK_TOKENS * CHARS_PER_TOKEN if isinstance(prompt, str) else CHUNK_TOKENS
    chain, h = [], 0
    for start in range(0, len(prompt) - unit + 1, unit):
        chunk = prompt[start:start + unit]
        h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
        chain.append(h)
    return chain


class PrefixIndex:
    """The chain hashes each replica was sent, least recently used first."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[int, None]] = {}

    def match(self, replica: str, chain: list[int]) -> int:
        """How many chunks of `chain`, from the start, `replica` holds."""
        held = self._held.get(replica, {})
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        return n

    def add(self, replica: str, chain: list[int], capacity: int) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for h in chain:
            held[h] = None
            held.move_to_end(h)
        while len(held) > capacity:
            held.popitem(last=False)

    def size(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def keep_only(self, replicas: set[str]) -> None:
        self._held = {r: held for r, held in self._held.items() if r in replicas}


def serving_model(replicas: list[RunningReplica], model: str | None) -> list[RunningReplica]:
    """The replicas that serve `model` (all when None). A replica that has not reported yet may serve it; when
    no replica is known to, all are returned and the replica refuses a model it does not serve."""
    if not model:
        return replicas
    reported = [(r, RoutingStats.of(r.routing_stats).model) for r in replicas]
    known = [r for r, serves in reported if serves == model]
    if known:
        return known
    return [r for r, serves in reported if serves is None] or replicas


def power_of_two(replicas: list) -> list[list]:
    """Serve's default choice as one rank: two random replicas (Serve takes the less busy, the first of equals)."""
    return [random.sample(replicas, min(2, len(replicas)))]


def rank_replicas(replicas: list[str], loads: dict[str, float], matches: dict[str, int],
                  imbalance: float) -> list[list[str]]:
    """The preference ranks of one request (Serve takes the least busy replica with room in the first rank that has
    one, the first of equals): the replicas holding the longest prefix of its prompt, least busy first, unless
    busier than the least busy by more than `imbalance`, then the others; when no replica holds a prefix of it, or
    every holder is too busy, the power of two choices.

    Equals are in random order: requests routed at the same moment see the same loads (Serve counts a request once
    it is sent), and a fixed order would send such a burst to one replica.

    Args:
        loads: ongoing requests per replica; matches: chunks of the prompt, from its start, each replica holds.
    """
    best = max(matches.values(), default=0)
    if best:
        lightest = min(loads.values())
        holders = [r for r in replicas if matches[r] == best and loads[r] - lightest <= imbalance]
        if holders:
            rest = [r for r in replicas if r not in holders]
            ranks = [holders, rest] if rest else [holders]
            return [sorted(random.sample(rank, len(rank)), key=loads.__getitem__) for rank in ranks]  # stable sort
    return power_of_two(replicas)


class LLMRouter(RequestRouter):
    """Model-aware, prefix-affine routing to LLMServer replicas (module docstring)."""

    def initialize_state(self, prefix_affinity: bool = True, imbalance: int = 4) -> None:
        """Serve calls this with the deployment's request_router_kwargs.

        Args:
            prefix_affinity: route by prompt prefix; False: power of two choices among the model's replicas.
            imbalance: how many more ongoing requests than the least busy replica the prefix's replica may have.
        """
        self.prefix_affinity = prefix_affinity
        self.imbalance = imbalance
        self.index = PrefixIndex()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, most preferred first; Serve takes the least busy of the first rank that has room."""
        request = _request_of(pending_request)
        candidates = serving_model(candidate_replicas, request.model if request else None)
        if not self.prefix_affinity or request is None or len(candidates) < 2:
            return power_of_two(candidates)
        chain = prefix_chain(request)
        ids = [r.replica_id.unique_id for r in candidates]
        matches = {i: self.index.match(i, chain) for i in ids}
        if not any(matches.values()):  # nothing to keep together: no need to know the loads here
            return power_of_two(candidates)
        loads = await self._loads(candidates)
        ranks = rank_replicas(ids, {i: loads[r.replica_id] for i, r in zip(ids, candidates)}, matches, self.imbalance)
        by_id = dict(zip(ids, candidates))
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _request_of(pending_request)
        replica = self.curr_replicas.get(replica_id)
        if not self.prefix_affinity or request is None or replica is None:
            return
        kv_tokens = RoutingStats.of(replica.routing_stats).kv_tokens
        capacity = INDEX_OVER_KV * kv_tokens // CHUNK_TOKENS if kv_tokens else UNBOUNDED_CHUNKS
        self.index.add(replica_id.unique_id, prefix_chain(request), capacity)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only({r.replica_id.unique_id for r in replicas})

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, float]:
        """Ongoing requests per replica: Serve's queue-length cache, probing the replicas missing from it."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id] is None]
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id] = queue_len
        # a replica that did not answer in time is taken as the busiest
        top = max((v for v in loads.values() if v is not None), default=0)
        return {r: (top + self.imbalance + 1 if v is None else v) for r, v in loads.items()}


def _request_of(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """LLMServer.generate's request, or None for the other methods (info, tokenize, probe)."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], GenerateRequest):
        return None
    return pending_request.args[0]
