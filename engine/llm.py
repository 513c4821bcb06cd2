"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.llm_engine import LLMEngine
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; results come back in prompt order.

        All prompts are validated before any runs, so one bad prompt raises without starting the others.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts: give one or one each")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, param_list)]
        results = {r.request_id: RequestOutput(r.request_id, r.prompt_token_ids) for r in requests}
        for request in requests:
            self.engine.add(request)
        with tqdm(total=len(requests), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for chunk in self.engine.step():
                    results[chunk.request_id].add(chunk)
                    bar.update(chunk.finished)
        return [results[r.request_id] for r in requests]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
