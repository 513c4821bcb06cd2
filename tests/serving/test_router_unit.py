"""serving/router.py's parts as plain functions: the prompt's chunk hash chain, what each replica was sent, the
preference ranks of one request, and the replicas serving a named model; and which router each `router` setting
gives the LLMServer deployment."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.app import _server
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.protocol import GenerateRequest, RoutingStats
from cpuserve.serving.router import (CHARS_PER_TOKEN, CHUNK_TOKENS, LLMRouter, PrefixIndex, prefix_chain, rank_replicas,
                                     serving_model)

TEXT_CHUNK = CHUNK_TOKENS * CHARS_PER_TOKEN


def chain_of(**request) -> list[int]:
    return prefix_chain(GenerateRequest(sampling=SamplingParams(), **request))


def test_the_chain_covers_full_chunks_and_shares_the_common_prefix():
    ids = list(range(3 * CHUNK_TOKENS + 5))
    chain = chain_of(prompt=ids)
    assert len(chain) == 3 and len(set(chain)) == 3
    other = chain_of(prompt=ids[:2 * CHUNK_TOKENS] + [9] * CHUNK_TOKENS)
    assert other[:2] == chain[:2] and other[2] != chain[2]
    assert chain_of(prompt=ids[:CHUNK_TOKENS - 1]) == []  # shorter than a chunk: nothing to route by
    assert len(chain_of(prompt="x" * (2 * TEXT_CHUNK + 1))) == 2  # text: characters per chunk


def test_chat_requests_sharing_a_system_prompt_share_its_chunks():
    system = {"role": "system", "content": "You answer questions about our product. " * 40}
    a = chain_of(messages=[system, {"role": "user", "content": "How do I reset it?"}])
    b = chain_of(messages=[system, {"role": "user", "content": "Where is the manual?"}])
    shared = len(f'[]{{"content": "{system["content"]}"') // TEXT_CHUNK
    assert shared >= 5 and a[:shared] == b[:shared]
    tools = chain_of(messages=[system], tools=[{"type": "function", "function": {"name": "f"}}])
    assert tools[0] != a[0], "tools change the prompt from its start"


def test_the_index_matches_from_the_start_and_forgets_the_least_recent():
    index = PrefixIndex()
    index.add("a", [1, 2, 3], capacity=4)
    assert [index.match("a", c) for c in ([1, 2, 3], [1, 2, 9], [9, 2], [])] == [3, 2, 0, 0]
    assert index.match("b", [1]) == 0
    index.add("a", [7, 8], capacity=4)  # 1 goes, least recently used
    assert index.size("a") == 4 and index.match("a", [1, 2]) == 0 and index.match("a", [7, 8]) == 2
    index.add("b", [5], capacity=4)
    index.keep_only({"b"})
    assert index.size("a") == 0 and index.size("b") == 1


@pytest.mark.parametrize("loads,matches,expected", [
    ({"a": 0, "b": 0}, {"a": 3, "b": 0}, [["a"], ["b"]]),  # the holder first
    ({"a": 4, "b": 0}, {"a": 3, "b": 0}, [["a"], ["b"]]),  # busier, within the imbalance
    ({"a": 1, "b": 0}, {"a": 3, "b": 3}, [["b", "a"]]),  # both hold it: the lighter first
    ({"a": 0, "b": 0}, {"a": 2, "b": 3}, [["b"], ["a"]]),  # the longest prefix wins
])
def test_rank_replicas_puts_the_holders_first(loads, matches, expected):
    assert rank_replicas(["a", "b"], loads, matches, imbalance=4) == expected


@pytest.mark.parametrize("loads,matches", [
    ({"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 0, "c": 0}),  # nobody holds a prefix
    ({"a": 5, "b": 0, "c": 0}, {"a": 3, "b": 0, "c": 0}),  # its holder is busier by more than the imbalance
])
def test_rank_replicas_without_a_holder_is_the_power_of_two_choices(loads, matches):
    """One rank of two random replicas, every pair in both orders: Serve's own default choice."""
    draws = [tuple(rank) for _ in range(600) for rank in rank_replicas(["a", "b", "c"], loads, matches, imbalance=4)]
    assert {len(set(d)) for d in draws} == {2}, "one rank of two distinct replicas"
    assert len(set(draws)) == 6, set(draws)  # 6 ordered pairs, 100 expected each: one missing ~1 in 10^46


@pytest.mark.parametrize("matches", [{"a": 0, "b": 0}, {"a": 3, "b": 3}])
def test_equals_come_first_at_random(matches):
    """Requests routed at the same moment see the same loads: a fixed order would send them all to one replica."""
    firsts = [rank_replicas(["a", "b"], {"a": 0, "b": 0}, matches, imbalance=4)[0][0] for _ in range(200)]
    assert 60 < firsts.count("a") < 140, firsts.count("a")  # binomial(200, 0.5): outside this about 1 in 10^7


@dataclass(eq=False)
class Replica:
    """What LLMRouter and Serve's own choice read of a RunningReplica; it answers Serve's probe with its load."""
    name: str
    routing_stats: dict = field(default_factory=dict)
    load: int = 0
    max_ongoing_requests: int = 16

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.load


DEPLOYMENT = DeploymentID(name="LLMServer", app_name="test")
PROMPT = list(range(4 * CHUNK_TOKENS))


def make_pending(prompt: list[int]) -> PendingRequest:
    request = GenerateRequest(sampling=SamplingParams(), prompt=prompt)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def make_router(replicas: list[Replica], imbalance: int = 4) -> LLMRouter:
    """A real LLMRouter as Serve sets one up, its queue-length cache holding each replica's load."""
    router = LLMRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                       use_replica_queue_len_cache=True)
    router.initialize_state(imbalance=imbalance)
    router.update_replicas(replicas)
    for r in replicas:
        router.on_new_queue_len_info(r.replica_id, r.load)
    return router


async def route(router: LLMRouter, replicas: list[Replica], prompt: list[int]) -> Replica:
    """As Serve routes: the first rank whose least busy replica has room (Serve's own choice within a rank,
    `_select_from_candidate_replicas`), then on_request_routed. Loads stay as the cache holds them."""
    pending = make_pending(prompt)
    for rank in await router.choose_replicas(replicas, pending):
        replica = await router._select_from_candidate_replicas(rank, backoff_index=0)
        if replica is not None:
            router.on_request_routed(pending, replica.replica_id, None)
            return replica
    raise AssertionError("no replica had room")


def route_each(loads: dict[str, int], prompts: list[list[int]]) -> list[str]:
    """The replicas a fresh router sends `prompts` to, one after another."""
    async def scenario() -> list[str]:
        replicas = [Replica(name, load=load) for name, load in loads.items()]
        router = make_router(replicas)
        return [(await route(router, replicas, prompt)).name for prompt in prompts]

    return asyncio.run(scenario())


def test_a_new_prompt_goes_to_the_less_busy_of_two_random_replicas():
    """Power of two choices over loads 0, 1, 2: `a` wins whenever drawn (2/3), `b` only against `c` (1/3), `c` never.
    The least busy of all would always give `a`."""
    chosen = [route_each({"a": 0, "b": 1, "c": 2}, [PROMPT])[0] for _ in range(300)]
    assert chosen.count("c") == 0
    assert 60 < chosen.count("b") < 140, chosen.count("b")  # binomial(300, 1/3), mean 100: outside ~1 in 10^5


def test_new_prompts_on_equally_busy_replicas_go_to_either():
    chosen = [route_each({"a": 3, "b": 3}, [PROMPT])[0] for _ in range(200)]
    assert 60 < chosen.count("a") < 140, chosen.count("a")  # binomial(200, 0.5): outside this about 1 in 10^7


def test_a_prompt_sharing_a_prefix_follows_it_unless_busier_by_more_than_the_imbalance():
    """`a` gets a prompt (the less busy then), then carries 4 more requests than `b`: a prompt sharing 3 of its 4
    chunks still goes to `a`, an unrelated one to `b` (the power of two choices); at 5 more, the shared one too."""
    shared = PROMPT[:3 * CHUNK_TOKENS] + [7] * CHUNK_TOKENS
    other = [9] * (4 * CHUNK_TOKENS)

    async def scenario() -> list[str]:
        a, b = Replica("a", load=0), Replica("b", load=1)
        router = make_router([a, b], imbalance=4)
        chosen = [await route(router, [a, b], PROMPT)]
        router.on_new_queue_len_info(a.replica_id, 4)
        router.on_new_queue_len_info(b.replica_id, 0)
        chosen += [await route(router, [a, b], shared), await route(router, [a, b], other)]
        router.on_new_queue_len_info(a.replica_id, 5)
        chosen.append(await route(router, [a, b], shared))
        return [r.name for r in chosen]

    for _ in range(20):
        assert asyncio.run(scenario()) == ["a", "a", "b", "b"]


def test_a_named_model_goes_to_the_replicas_serving_it():
    old, new = Replica("old", RoutingStats(model="a").to_dict()), Replica("new", RoutingStats(model="b").to_dict())
    starting = Replica("starting")
    assert serving_model([old, new], None) == [old, new]
    assert serving_model([old, new, starting], "b") == [new]
    assert serving_model([old, starting], "b") == [starting], "one that has not reported yet may serve it"
    assert serving_model([old], "b") == [old], "none does: the replica refuses it, naming its model"


@pytest.mark.parametrize("router,cls,kwargs", [
    ("prefix", "cpuserve.serving.router:LLMRouter", {"prefix_affinity": True}),
    ("power-of-two", "cpuserve.serving.router:LLMRouter", {"prefix_affinity": False}),
    ("serve", "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter", {}),  # Serve's default
])
def test_the_router_setting_picks_the_deployments_request_router(router, cls, kwargs):
    config = _server(ServeConfig(router=router))._deployment_config.request_router_config
    assert (config.request_router_class, config.request_router_kwargs) == (cls, kwargs)
