"""One request per way a client changes what the sampler returns: every SamplingParams field off its default, each
structured-output form the APIs accept (response_format, guided_*, gRPC's structured_output) and each tool_choice
that forces a call's grammar. Each comes with a contrast: the same request with that field (or form) back at its
default, so a test can check that the field really changed the output, not only that two runs agree.

Shared by the sampler's own tests (test_sampler.py) and the replica-group tests (test_tensor_parallel.py). A field
added to SamplingParams needs an example here, or test_every_sampling_field_has_an_example fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.protocol import structured_output
from cpuserve.serving.tools import HERMES, tool_grammar

BASE = {"max_tokens": 12, "temperature": 0.0}
CHAT = [{"role": "user", "content": "Name three fruits and say which one you like best, and why."}]
# ends on eos early (8 tokens: "The capital of France is Paris."); "Answer with one word: is the sky blue?" ended
# within 12 tokens on Zen 4 and the Xeon, but not on a Zen 5, whose torch arithmetic moves a near-tie
SHORT_CHAT = [{"role": "user", "content": "What is the capital of France? One word."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}},
         {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}]
FRUIT_SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12},
                                                 "reason": {"type": "string", "maxLength": 40}},
                "required": ["fruit", "reason"], "additionalProperties": False}


@dataclass(frozen=True)
class Example:
    name: str
    params: SamplingParams
    contrast: SamplingParams  # params with the field (or form) under test at its default
    messages: tuple = tuple(CHAT)

    @property
    def changed(self) -> set[str]:
        """The SamplingParams fields this example sets off its contrast."""
        return {f.name for f in dataclasses.fields(SamplingParams)
                if getattr(self.params, f.name) != getattr(self.contrast, f.name)}


def _example(name: str, changes: dict, contrast: dict | None = None, messages: list | None = None,
             base: dict | None = None) -> Example:
    """changes on top of BASE (and base); the contrast puts every changed field back to its default, or to
    `contrast`'s values."""
    start = {**BASE, **(base or {})}
    defaults = SamplingParams()
    back = contrast if contrast is not None else {k: getattr(defaults, k) for k in changes}
    return Example(name, SamplingParams(**{**start, **changes}), SamplingParams(**{**start, **back}),
                   tuple(messages or CHAT))


def _structured(name: str, kind: str, value, param: str) -> Example:
    return _example(name, {"structured_output": structured_output(kind, value, param)})


def examples(token_id: Callable[[str], int]) -> list[Example]:
    """Every example; token_id(text) is the model's id of a one-token text (logit_bias, stop_token_ids)."""
    seeded = {"temperature": 1.0, "seed": 5}
    return [
        # the sampler's filters and noise
        _example("temperature", {"temperature": 1.6}, base={**seeded, "top_k": 40}),
        _example("top_k", {"top_k": 3}, base=seeded),
        _example("top_p", {"top_p": 0.5}, base=seeded),
        _example("min_p", {"min_p": 0.2}, base=seeded),
        _example("min_p_with_top_k", {"min_p": 0.3}, base={**seeded, "top_k": 20}),
        _example("seed", {"seed": 7}, contrast={"seed": 8}, base=seeded),
        # what moves logits before the pick, greedy (the case a replica group once reduced to its top 1)
        _example("logit_bias", {"logit_bias": {token_id(" banana"): 9.0, token_id(" Apple"): -100.0}}),
        _example("repetition_penalty", {"repetition_penalty": 1.6}, base={"max_tokens": 24}),
        _example("presence_penalty", {"presence_penalty": 1.8}, base={"max_tokens": 24}),
        _example("frequency_penalty", {"frequency_penalty": 1.8}, base={"max_tokens": 24}),
        _example("logprobs", {"logprobs": 3}),
        _example("logprobs_sampled", {"logprobs": 0}, base={**seeded, "top_k": 10}),
        # each structured-output form (HTTP response_format / guided_*, gRPC structured_output) and tool calls
        _structured("json_schema", "json_schema", FRUIT_SCHEMA, "response_format"),
        _structured("json_object", "json_object", None, "response_format"),
        _structured("regex", "regex", r"I like (apples|pears|plums) because [a-z ]{3,30}\.", "guided_regex"),
        _structured("lark_grammar", "grammar", 'start: "Best: " FRUIT "!"\nFRUIT: "kiwi" | "mango" | "fig"',
                    "guided_grammar"),
        _structured("gbnf_grammar", "grammar", 'root ::= "Fruits: " [a-z]+ ", " [a-z]+', "guided_grammar"),
        _structured("choice", "choice", ["pear", "plum", "quince"], "guided_choice"),
        _example("tool_choice_required", {"structured_output": {
            "kind": "grammar", "spec": tool_grammar(HERMES, TOOLS, None, True)}}),
        _example("tool_choice_named", {"structured_output": {
            "kind": "grammar", "spec": tool_grammar(HERMES, TOOLS, "add", False)}}),
        # what the output processor reads: they change where and how the output ends, never a pick
        _example("max_tokens", {"max_tokens": 4}),
        _example("stop", {"stop": [" among"]}),
        _example("stop_token_ids", {"stop_token_ids": [token_id(" among")]}),
        _example("ignore_eos", {"ignore_eos": True}, messages=SHORT_CHAT),
        _example("skip_special_tokens", {"skip_special_tokens": False}, base={"ignore_eos": True},
                 messages=SHORT_CHAT),
    ]
