"""Text <-> token ids and chat templates, over a `tokenizers.Tokenizer` built by the loader.

The loader builds the backend from the checkpoint itself (GGUF metadata or tokenizer.json), so the
tokenizer always comes from the same file as the weights. This class adds what the backend lacks:
which ids end a turn, and the model's own Jinja chat template, rendered in a sandbox because the
template is data from the checkpoint, not code we wrote.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

# Token texts that end a turn in common chat formats (llama.cpp treats these as end-of-generation too).
END_OF_TURN_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>", "<|end_of_text|>"}
)


def _raise_exception(message: str) -> None:
    # templates call raise_exception('...') to reject a conversation (e.g. roles out of order)
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON (as transformers renders it)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids and the chat template.

    Args:
        backend: the `tokenizers.Tokenizer`; its post-processor adds BOS (or not) as the model wants.
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: every id that ends generation (eos plus end-of-turn tokens).
        chat_template: the model's Jinja chat template, or None.
        special_token_texts: extra variables for the template (bos_token, eos_token, ...).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        special_token_texts: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.special_token_texts = dict(special_token_texts or {})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended only if the model wants it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError(
                "this model's checkpoint has no chat template (GGUF key tokenizer.chat_template, or "
                "chat_template in tokenizer_config.json / chat_template.jinja); use plain completion instead"
            )
        # same environment options as transformers, so whitespace in templates renders identically
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation as the prompt text the model was trained on.

        Args:
            messages: [{"role": "user", "content": "..."}, ...].
            add_generation_prompt: end with the header that opens the assistant's turn.
            **kwargs: extra template variables (tools=..., documents=...).

        Returns:
            The prompt string (it already contains any BOS text, so encode it with add_special_tokens=False
            when the template writes BOS itself).
        """
        variables = {**self.special_token_texts, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
