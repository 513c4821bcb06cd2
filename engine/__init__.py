"""cpuserve's engine. The offline API reads as vLLM's: `from cpuserve.engine import LLM, SamplingParams`.

Names are imported on first use (module __getattr__), so importing a light submodule such as
`cpuserve.engine.outputs` or `cpuserve.engine.errors` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpuserve.engine.async_engine import AsyncLLMEngine
    from cpuserve.engine.errors import InvalidRequest
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.outputs import RequestOutput, StepOutput, TokenLogprob
    from cpuserve.engine.sampling_params import SamplingParams

# public name -> the submodule defining it
_EXPORTS = {"LLM": "llm", "SamplingParams": "sampling_params", "AsyncLLMEngine": "async_engine",
            "InvalidRequest": "errors", "RequestOutput": "outputs", "StepOutput": "outputs",
            "TokenLogprob": "outputs"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # the next lookup skips this function
    return value
