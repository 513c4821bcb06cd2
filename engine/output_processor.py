"""Where a request ends, decided in one place, and the StepOutputs the engine hands back.

Each new token is detokenized (text_stream.py) and checked against every stop condition at once: eos, stop token
ids, a finished grammar, max_tokens, the context length and stop strings. A constrained request's matcher takes
each token first, so its next mask (engine/grammar.py) follows the output. The engine then tells the scheduler to
finish the request.
"""

from __future__ import annotations

from cpuserve.engine.outputs import StepOutput, TokenLogprob
from cpuserve.engine.request import Request, RequestStatus
from cpuserve.engine.text_stream import TextStream
from cpuserve.engine.tokenizer import Tokenizer


def token_stop(request: Request) -> RequestStatus | None:
    """The stop conditions that need no text: eos, stop token ids, max_tokens, context length."""
    last = request.all_token_ids[-1]
    params = request.params
    if not params.ignore_eos and last in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if last in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.is_stopped():  # the grammar allows nothing more
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class OutputProcessor:
    """Owns each live request's text stream; touched only by the thread that steps the engine."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._streams: dict[str, TextStream] = {}

    def add(self, request: Request) -> None:
        params = request.params
        self._streams[request.request_id] = TextStream(
            self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens)

    def decode(self, request: Request, token_id: int) -> tuple[str, RequestStatus | None]:
        """The text this token adds and, if the request ends with it, how: the one stop decision."""
        if request.grammar is not None:
            request.grammar.consume_token(token_id)  # the mask allowed it, so the matcher accepts it
        status = token_stop(request)
        text, hit_stop_string = self._streams[request.request_id].add(token_id, final=status is not None)
        return text, RequestStatus.FINISHED_STOPPED if hit_stop_string else status

    def token_output(self, request: Request, token_id: int, text: str, logprob: TokenLogprob | None) -> StepOutput:
        return self._output(request, [token_id], text, logprob)

    def finished_output(self, request: Request) -> StepOutput:
        """The last chunk of a request that ended without a new token (aborted, or never fits the pool)."""
        return self._output(request, [], "", None)

    def _output(self, request: Request, ids: list[int], text: str, logprob: TokenLogprob | None) -> StepOutput:
        finished = request.is_finished
        if finished:
            self._streams.pop(request.request_id, None)
        first = request.num_output_tokens == len(ids) and ids
        queue_time = (request.first_scheduled_time - request.arrival_time
                      if first and request.first_scheduled_time is not None else None)
        return StepOutput(
            request_id=request.request_id, new_token_ids=ids, new_text=text,
            logprobs=[logprob] if logprob is not None else None, finished=finished,
            finish_reason=request.status.finish_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens, num_generated_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, queue_time=queue_time,
            num_draft_tokens=request.num_draft_tokens, num_accepted_tokens=request.num_accepted_tokens)
