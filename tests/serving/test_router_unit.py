"""serving/router.py's parts as plain functions: the prompt's chunk hash chain, what each replica was sent, the
preference ranks of one request, and the replicas serving a named model; and which router each `router` setting
gives the LLMServer deployment."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.app import _server
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.protocol import GenerateRequest, RoutingStats
from cpuserve.serving.router import CHARS_PER_TOKEN, CHUNK_TOKENS, PrefixIndex, prefix_chain, rank_replicas, serving_model

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


@pytest.mark.parametrize("loads,matches,sizes,expected", [
    ({"a": 0, "b": 0}, {"a": 3, "b": 0}, {"a": 9, "b": 0}, [["a"], ["b"]]),  # the holder first
    ({"a": 4, "b": 0}, {"a": 3, "b": 0}, {"a": 9, "b": 0}, [["a"], ["b"]]),  # busier, within the imbalance
    ({"a": 5, "b": 0}, {"a": 3, "b": 0}, {"a": 9, "b": 0}, [["b", "a"]]),  # too busy: the least busy
    ({"a": 1, "b": 0}, {"a": 3, "b": 3}, {"a": 9, "b": 9}, [["b", "a"]]),  # both hold it: the lighter first
    ({"a": 0, "b": 0}, {"a": 2, "b": 3}, {"a": 9, "b": 9}, [["b"], ["a"]]),  # the longest prefix wins
    ({"a": 0, "b": 0}, {"a": 0, "b": 0}, {"a": 9, "b": 2}, [["b", "a"]]),  # new prefix: the smaller holder
    ({"a": 0, "b": 1}, {"a": 0, "b": 0}, {"a": 9, "b": 2}, [["a", "b"]]),  # ... unless busier
])
def test_rank_replicas(loads, matches, sizes, expected):
    assert rank_replicas(["a", "b"], loads, matches, sizes, imbalance=4) == expected


@pytest.mark.parametrize("matches,sizes", [({"a": 0, "b": 0}, {"a": 2, "b": 2}), ({"a": 3, "b": 3}, {"a": 9, "b": 2})])
def test_equals_come_first_at_random(matches, sizes):
    """Requests routed at the same moment see the same loads: a fixed order would send them all to one replica."""
    firsts = [rank_replicas(["a", "b"], {"a": 0, "b": 0}, matches, sizes, imbalance=4)[0][0] for _ in range(200)]
    assert 60 < firsts.count("a") < 140, firsts.count("a")  # binomial(200, 0.5): outside this about 1 in 10^7


@dataclass
class Replica:  # what serving_model reads of Serve's RunningReplica
    name: str
    routing_stats: dict = field(default_factory=dict)


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
