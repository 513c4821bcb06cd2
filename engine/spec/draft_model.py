"""The draft-model drafter: a model with the target's tokenizer proposes tokens greedily, from a KV pool of its own.

Per request it keeps the tokens whose KV its pool holds. Once a step (prepare), for the requests that may draft:
    1. catch up: the longest common prefix of what it holds and the request's tokens stays, the blocks past it go
       back to its pool (a rejected draft), the request's tokens after it run as one chunk: its logits give d1;
    2. k-1 rounds of one decode row per drafting request give d2..dk.
Each round runs every drafting request in one batch of the draft's own ModelRunner: a step costs k forwards of the
draft model, however many requests draft in it. The target's KV pool and prefix cache are never touched.

    held after a step:  | t0 .. tn-1 | d1 d2 d3 |        (d4's KV is never computed)
    the target kept d1 d2 and said x:  | t0 .. tn-1 | d1 d2 x |
    next catch-up:      keep t0 .. d2, free the blocks past them, run x (and whatever else followed)

A greedy proposal is a point mass on its token, so verify.py's acceptance rule (keep d with probability p(d), else
draw from p without d) is speculative sampling's for sampled requests too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler_output import SamplingInputs, ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0)


@dataclass(slots=True, eq=False)
class _Held:
    """What the draft pool holds of one request, shaped as the BlockManager reads a request."""

    token_ids: list[int] = field(default_factory=list)  # the request's tokens, then the draft so far
    num_computed_tokens: int = 0  # leading token_ids whose KV is in the draft pool
    block_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_hashed_blocks: int = 0  # always 0: the draft pool caches no prefix
    last_step: int = 0  # the drafter's step that last drafted for it (which to evict first)


class DraftModelDrafter:
    """Args:
        runner: the draft model's ModelRunner, over its own pool of block_manager.num_blocks blocks.
        block_manager: the draft pool's bookkeeping (no prefix caching).
        max_model_len: the draft's context; it drafts nothing past it.
        vocab_size: the target's; a draft token at or past it ends the draft there.
    """

    def __init__(self, runner, block_manager: BlockManager, max_model_len: int, vocab_size: int):
        assert not block_manager.enable_prefix_caching
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._held: dict[str, _Held] = {}
        self._drafts: dict[str, list[int]] = {}
        self._num_steps = 0

    def prepare(self, requests: list[Request], max_tokens: list[int]) -> None:
        """Draft for every request that may draft this step, max_tokens[i] tokens at most, in k batched rounds."""
        self._num_steps += 1
        self._drafts = {}
        for request in requests:  # drafting this step: not to be evicted for another's room
            if (held := self._held.get(request.request_id)) is not None:
                held.last_step = self._num_steps
        active: list[tuple[str, _Held, int]] = []  # (request id, held, tokens to draft)
        for request, k in zip(requests, max_tokens):
            k = min(k, self.max_model_len - request.num_tokens)
            if k > 0 and (held := self._catch_up(request, k)) is not None:
                active.append((request.request_id, held, k))
                self._drafts[request.request_id] = []
        while active:
            items = sorted(((self._item(rid, held), (rid, held, k)) for rid, held, k in active),
                           key=lambda pair: not pair[0].is_decode)  # the runner takes decode rows first
            result = self.runner.run(SchedulerOutput([item for item, _ in items]))
            still = []
            for (_, (rid, held, k)), (token,) in zip(items, result.token_ids):
                held.num_computed_tokens = len(held.token_ids)
                draft = self._drafts[rid]
                if token >= self.vocab_size:  # a padded row of the draft's vocabulary: no token of the target's
                    continue
                draft.append(token)
                if len(draft) < k:
                    held.token_ids.append(token)  # the next round computes its KV
                    still.append((rid, held, k))
            active = still

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """This step's draft for the request (prepare made it), cut to max_tokens; [] when it has none."""
        return self._drafts.get(request.request_id, [])[:max_tokens]

    def forget(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.block_manager.free(held)
        self._drafts.pop(request_id, None)

    def populate_kv(self) -> bool:
        return self.runner.populate_kv()

    def _catch_up(self, request: Request, k: int) -> _Held | None:
        """The request's held state, trimmed to what agrees with its tokens (at least its last token left to run)
        and with blocks for its tokens and k-1 draft tokens; None when the draft pool has no room for them."""
        held = self._held.setdefault(request.request_id, _Held(num_prompt_tokens=request.num_prompt_tokens))
        tokens = request.all_token_ids
        held.num_computed_tokens = _common_prefix(held.token_ids, tokens, min(held.num_computed_tokens,
                                                                              len(tokens) - 1))
        held.token_ids = list(tokens)
        self.block_manager.trim(held, held.num_computed_tokens)
        num_new = len(tokens) - held.num_computed_tokens + k - 1
        if not self.block_manager.allocate_slots(held, num_new):
            self._evict_idle()
            if not self.block_manager.allocate_slots(held, num_new):
                return None
        held.last_step = self._num_steps
        return held

    def _evict_idle(self) -> None:
        """Free what the pool holds of requests that draft nothing this step (they catch up again if they do)."""
        for request_id, held in list(self._held.items()):
            if held.last_step < self._num_steps:
                self.forget(request_id)

    def _item(self, request_id: str, held: _Held) -> ScheduledRequest:
        """Every token the pool does not hold yet: the first round's catch-up (its prompt part as prompt rows), then
        the last draft token, one decode row."""
        start, end = held.num_computed_tokens, len(held.token_ids)
        num_prompt = max(0, min(end, held.num_prompt_tokens) - start)
        sampling = SamplingInputs(GREEDY, None, held.token_ids, held.num_prompt_tokens)
        return ScheduledRequest(request_id, held.token_ids[start:end], start, True,
                                held.block_ids[:self.block_manager.num_blocks_for(end)], num_prompt, sampling)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most limit."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


def build_draft_model_drafter(config, tokenizer, vocab_size: int, max_model_len: int) -> DraftModelDrafter:
    """Load config.spec_draft_model (None: the embedded SmolLM2) into a runner over its own pool of
    spec_draft_kv_cache_gb. Raises ValueError, naming spec_draft_model, when its vocabulary is not the target's
    tokenizer's: its token ids would mean other text."""
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import ModelRunner, kv_bytes_per_token
    from cpuserve.engine.models.builder import build_model

    checkpoint = load_checkpoint(config.spec_draft_model, show_progress=False)
    vocab = checkpoint.tokenizer.backend.get_vocab(with_added_tokens=True)
    if vocab != tokenizer.backend.get_vocab(with_added_tokens=True):
        name = config.spec_draft_model or "the embedded SmolLM2-135M-Instruct"
        target = config.model or "the embedded SmolLM2-135M-Instruct"
        raise ValueError(f"spec_draft_model={name!r}: its tokenizer's vocabulary ({len(vocab)} tokens) is not the "
                         f"one of model={target!r} ({tokenizer.vocab_size} tokens); a draft model must share the "
                         "model's tokenizer")
    weights = config.spec_draft_weights or config.weights
    activations = "int8" if config.activations == "int8-token" and weights != "int8" else config.activations
    draft_len = min(max_model_len, checkpoint.args.max_seq_len)
    bytes_per_block = kv_bytes_per_token(checkpoint.args, config.kv_cache) * config.block_size
    num_blocks = int(config.spec_draft_kv_cache_gb * (1 << 30)) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"spec_draft_kv_cache_gb={config.spec_draft_kv_cache_gb} holds no block of {config.block_size}"
                         f" tokens of the draft model ({bytes_per_block} bytes); raise it")
    model = build_model(checkpoint, weights, config.group_size, config.show_progress, activations)
    runner = ModelRunner(model, config.kv_cache, num_blocks, config.block_size, draft_len)
    return DraftModelDrafter(runner, BlockManager(num_blocks, config.block_size, enable_prefix_caching=False),
                             draft_len, vocab_size)
