"""Sampling: a pure function from (logits, params) to token ids. Temperature 0 is argmax."""

from __future__ import annotations

import functools
import itertools
from dataclasses import MISSING, dataclass, fields

import torch

from cpuserve.engine.layers import ops
from cpuserve.engine.outputs import ModelRunnerOutput, TokenLogprob
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler_output import SamplingInputs, ScheduledRequest
from cpuserve.engine.spec.verify import accept_or_resample, accepted_prefix, draw, greedy_tokens

# Which of a row's logits decide its pick, by SamplingParams field (a replica group gathers only those at rank 0,
# engine/distributed/step.py):
#   OUTPUT_FIELDS  read by the output processor, never here (stop conditions, text): they change no pick
#   TOP_K_FIELDS   keep the pick among the row's top_k largest logits (greedy: the largest): temperature, the
#                  filters applied after top-k (top_p, min_p) and the seed, whose noise covers the whole row anyway
# Any other field (logit_bias, the penalties, logprobs, structured_output; and a field added later until it is
# declared here) can make any token count while it is off its default, so such a row needs the whole row.
OUTPUT_FIELDS = frozenset({"max_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens"})
TOP_K_FIELDS = frozenset({"temperature", "top_k", "top_p", "min_p", "seed"})
WHOLE_ROW = 0  # num_top_logits: every logit of the row


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[list[int]],
    num_prompt_tokens: list[int],
    grammars: list | None = None,
) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: [S, V] float32, one row per sequence that samples this step.
        params: the sequences' sampling parameters.
        generators: per-sequence RNG; a seeded request draws only from its own generator, so its tokens do not
            depend on what else is in the batch.
        histories: every token of each sequence so far (prompt + output), for the penalties.
        num_prompt_tokens: where the output starts in each history (presence penalty counts output only).
        grammars: per sequence, its llguidance matcher or None; a constrained row only samples tokens its grammar
            allows. None (or all None): no row is constrained, and the step pays nothing for the feature.
    """
    # logprobs are of the model's raw distribution, as OpenAI reports: taken before the bias and the in-place mask
    all_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    if any(p.logit_bias for p in params):
        logits = add_logit_bias(logits, params)
    if grammars is not None and any(g is not None for g in grammars):
        logits = mask_constrained(logits, grammars)
    if all(p.is_greedy and not _has_penalty(p) for p in params):
        # fast path: the whole batch in one op (ops.argmax_rows: torch's max takes ~43 us a row of 49152 on a core)
        token_ids = ops.argmax_rows(logits).tolist()
    else:
        token_ids = [
            _sample_row(logits[i], p, generators[i], histories[i], num_prompt_tokens[i]) for i, p in enumerate(params)
        ]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if all_logprobs is not None:
        for i, p in enumerate(params):
            if p.logprobs is not None:
                logprobs[i] = _logprob_of(all_logprobs[i], token_ids[i], p.logprobs)
    return SamplerOutput(token_ids, logprobs)


def sample_scheduled(logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
    """The one sampling path of every runner: logits [R, V] hold each item of `scheduled` that samples its
    num_logit_rows rows (one, or one per draft token and one more: engine/spec/verify.py)."""
    if any(item.num_draft_tokens for item in scheduled):
        return _sample_with_drafts(logits, scheduled)
    inputs = [item.sampling for item in scheduled if item.needs_sample]
    result = sample(logits, [i.params for i in inputs], [i.generator for i in inputs], [i.history for i in inputs],
                    [i.num_prompt_tokens for i in inputs], [i.grammar for i in inputs])
    return ModelRunnerOutput.place(scheduled, result.token_ids, result.logprobs)


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, vocab_size: int,
                      scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
    """sample_scheduled for a step whose logits came as candidates (a replica group's reduction): values and token
    ids [R, C], holding at least each row's num_top_logits largest logits; every other logit is -inf.

    When every row is greedy and needs only its largest logit, the pick is that logit's id, the lowest among equals
    (what sample's argmax takes of the full row), without building the [R, V] row: ~1 ms a step at 32 rows of 49k.
    """
    samplers = [item for item in scheduled if item.needs_sample]
    if all(item.sampling.params.is_greedy and num_top_logits(item.sampling) == 1 for item in samplers):
        best = values.max(dim=1, keepdim=True).values  # [R, 1]
        is_best = (values == best) | values.isnan()  # a NaN counts as the largest, as in ops.argmax_rows
        targets = ids.masked_fill(~is_best, vocab_size).min(dim=1).values.tolist()
        tokens = greedy_tokens(targets, samplers)
        return ModelRunnerOutput.place_lists(scheduled, tokens, [[None] * len(t) for t in tokens])
    logits = torch.full((values.shape[0], vocab_size), float("-inf")).scatter_(1, ids, values)  # [R, V]
    return sample_scheduled(logits, scheduled)


def _sample_with_drafts(logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
    """sample_scheduled for a step with drafts: the plain items' rows through one sample() call, each draft's rows
    through sample_draft."""
    samplers = [item for item in scheduled if item.needs_sample]
    starts = list(itertools.accumulate((item.num_logit_rows for item in samplers), initial=0))
    tokens: list[list[int]] = [[] for _ in samplers]
    logprobs: list[list[TokenLogprob | None]] = [[] for _ in samplers]
    plain = [k for k, item in enumerate(samplers) if not item.num_draft_tokens]
    if plain:
        inputs = [samplers[k].sampling for k in plain]
        result = sample(logits[torch.tensor([starts[k] for k in plain])], [i.params for i in inputs],
                        [i.generator for i in inputs], [i.history for i in inputs],
                        [i.num_prompt_tokens for i in inputs], [i.grammar for i in inputs])
        for k, token_id, logprob in zip(plain, result.token_ids, result.logprobs):
            tokens[k], logprobs[k] = [token_id], [logprob]
    for k, item in enumerate(samplers):
        if item.num_draft_tokens:
            tokens[k], logprobs[k] = sample_draft(logits[starts[k]:starts[k + 1]], item.sampling, item.draft)
    return ModelRunnerOutput.place_lists(scheduled, tokens, logprobs)


def sample_draft(rows: torch.Tensor, inputs: SamplingInputs, draft: list[int]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
    """The new tokens of one drafted sequence and their logprobs (engine/spec/verify.py's rule).

    rows [k + 1, V]: row j holds the logits after the sequence's tokens and draft[:j]. A plain greedy row is argmax
    at once; any other runs row by row, the history and the grammar taking each accepted draft token first (the
    grammar is rolled back after: the output processor feeds it the tokens that are kept).
    """
    p = inputs.params
    raw = torch.log_softmax(rows, dim=-1) if p.logprobs is not None else None  # before any in-place mask
    if p.is_greedy and not _has_penalty(p) and not p.logit_bias and inputs.grammar is None:
        targets = ops.argmax_rows(rows.contiguous()).tolist()
        tokens = targets[:accepted_prefix(targets, draft) + 1]
    else:
        tokens = _sample_draft_rows(rows, inputs, draft)
    return tokens, [_logprob_of(raw[j], t, p.logprobs) if raw is not None else None for j, t in enumerate(tokens)]


def _sample_draft_rows(rows: torch.Tensor, inputs: SamplingInputs, draft: list[int]) -> list[int]:
    p, grammar = inputs.params, inputs.grammar
    history = list(inputs.history)  # the request's own list is read, never written, during the step
    tokens: list[int] = []
    try:
        for j in range(len(draft) + 1):
            row = rows[j:j + 1].clone()  # [1, V]
            proposed = draft[j] if j < len(draft) else None
            if p.is_greedy:
                token_id = sample(row, [p], [inputs.generator], [history], [inputs.num_prompt_tokens],
                                  [grammar]).token_ids[0]
            else:
                token_id = accept_or_resample(_row_probs(row, p, history, inputs.num_prompt_tokens, grammar),
                                              proposed, inputs.generator)
            tokens.append(token_id)
            if token_id != proposed:
                break
            history.append(token_id)
            if grammar is not None:
                grammar.consume_token(token_id)
    finally:
        if grammar is not None and len(history) > len(inputs.history):
            grammar.rollback(len(history) - len(inputs.history))
    return tokens


def _row_probs(row: torch.Tensor, p: SamplingParams, history: list[int], num_prompt: int, grammar) -> torch.Tensor:
    """The distribution a sampled row draws from (sample's and _sample_row's steps): [1, V] logits -> [V]."""
    if p.logit_bias:
        row = add_logit_bias(row, [p])
    if grammar is not None:
        row = mask_constrained(row, [grammar])
    logits = row[0]
    if _has_penalty(p):
        logits = apply_penalties(logits, p, history, num_prompt)
    return logits_to_probs(logits, p)


def num_top_logits(inputs: SamplingInputs) -> int:
    """How many of a row's largest logits decide what sample() returns for it: 1 when greedy, top_k when set, else
    WHOLE_ROW. Logits outside that many change neither the token nor anything else sample() returns."""
    p = inputs.params
    if inputs.grammar is not None or any(getattr(p, name) != default for name, default in _whole_row_defaults(type(p))):
        return WHOLE_ROW
    return 1 if p.is_greedy else p.top_k  # top_k 0 (off): WHOLE_ROW


@functools.cache
def _whole_row_defaults(params_type: type) -> tuple[tuple[str, object], ...]:
    """(name, default) of every field that needs the whole row when set (neither OUTPUT_FIELDS nor TOP_K_FIELDS)."""
    return tuple((f.name, f.default if f.default is not MISSING else f.default_factory())
                 for f in fields(params_type) if f.name not in OUTPUT_FIELDS | TOP_K_FIELDS)


def mask_constrained(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    """Every token a row's grammar forbids set to -inf, in place on the constrained rows (others untouched);
    returns `logits`.

    Each matcher writes its allowed tokens as bits (bit j of int32 word w = token 32w + j), one row per constrained
    sequence (~6 us a row, llguidance); apply_bitmask then adds them as 0 / -inf. bench/structured.py measures both.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    bitmask = torch.empty((len(rows), (logits.shape[-1] + 31) // 32), dtype=torch.int32)
    for k, i in enumerate(rows):
        fill_bitmask(grammars[i], bitmask[k])
    apply_bitmask(logits, bitmask, rows)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[k], t] = -inf where bit t of bitmask[k] is 0, in place.

    Branch-free: each byte of the mask looks up its 8 biases (0 or -inf) in a 256 x 8 table (one embedding op),
    and the biases are added to the rows. masked_fill with a bool mask branches per token and cost 70-230 us a
    row of 49152 tokens here, depending on how many the grammar allows; this costs ~26 us whatever the mask
    (llguidance.torch's apply needs torch.compile: 5.7 us a row, after a 45 s compile in each process).
    """
    table = _byte_bias(logits.dtype)
    # bitmask [R, W] int32 -> [R, 4W] bytes, little-endian: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).to(torch.int32), table)  # [R, 4W, 8]
    bias = bias.view(len(rows), -1)[:, :logits.shape[-1]]  # [R, V]
    logits.index_add_(0, torch.tensor(rows, dtype=torch.long), bias)


@functools.cache
def _byte_bias(dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry [b, j] is 0 when bit j of byte b is set (allowed), else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype)


def fill_bitmask(matcher, row: torch.Tensor) -> None:
    """Write the matcher's allowed next tokens into one contiguous int32 row (llguidance's bitmask layout)."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (a new tensor)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    return logits


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None, history: list[int], num_prompt: int
) -> int:
    if _has_penalty(p):
        logits = apply_penalties(logits, p, history, num_prompt)
    if p.is_greedy:
        return int(logits.argmax())
    return draw(logits_to_probs(logits, p), generator)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, history: list[int], num_prompt: int) -> torch.Tensor:
    logits = logits.clone()
    if p.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        values = logits[seen]
        # CTRL-style: shrink positive logits, grow negative ones, so a repeated token always loses probability
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    output = history[num_prompt:]
    if p.presence_penalty != 0.0 and output:
        logits[torch.tensor(sorted(set(output)), dtype=torch.long)] -= p.presence_penalty
    if p.frequency_penalty != 0.0 and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.numel())[:logits.numel()]
        logits -= p.frequency_penalty * counts.to(logits.dtype)
    return logits


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of exactly k largest logits of each row ([..., V] -> [..., k]), largest first, the lowest ids among
    equals (bf16 logits tie often): what a stable descending sort puts first, without sorting the whole row (a
    full sort of SmolLM2's 49152 logits took 2.8 ms a row, 90 ms for a step of 32 sampled rows)."""
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    greater, equal = logits > kth, logits == kth
    keep = greater | (equal & (equal.cumsum(-1) <= k - greater.sum(-1, keepdim=True)))
    if int(keep.sum()) != k * keep[..., 0].numel():  # NaN logits compare with nothing: the sort decides
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    ids = keep.nonzero()[:, -1].view(*logits.shape[:-1], k)  # ascending in each row
    order = torch.sort(logits.gather(-1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order)


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters; returns renormalised probabilities [V]."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        # exactly top_k tokens (top_k_ids); a replica group's shards take their candidates the same way
        # (step.local_candidates), so they hold these
        keep = torch.zeros_like(logits, dtype=torch.bool).index_fill(0, top_k_ids(logits, p.top_k), True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _logprob_of(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = torch.topk(row, num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(row[token_id]), top)
