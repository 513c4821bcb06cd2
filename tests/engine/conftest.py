"""Engines and the Hugging Face reference, loaded once per test session (each load takes seconds)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def model_path() -> str:
    from cpuserve.engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    from cpuserve.engine.llm import LLM

    return LLM(weights="fp32", kv_cache="fp32", kv_cache_gb=0.25, show_progress=False)


@pytest.fixture(scope="session")
def llm_int4():
    from cpuserve.engine.llm import LLM

    return LLM(weights="int4", kv_cache="int8", kv_cache_gb=0.25, show_progress=False)


@pytest.fixture(scope="session")
def decoded(llm_int4):
    """The speculative tests' requests (spec_cases.py) run without speculation, in one batch: (prompts, outputs)."""
    from spec_cases import decode_all

    return decode_all(llm_int4)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers loading the same GGUF, dequantized to fp32: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return model.eval()


def pytest_terminal_summary(terminalreporter) -> None:
    """Which CPU-dependent kernel paths this run did not take (kernel_paths.py): a pass here says nothing of them."""
    import kernel_paths

    missing = kernel_paths.not_run()
    if missing is None:
        return
    terminalreporter.section("kernel paths (engine/csrc) this run did not take")
    for line in missing or ["none: every CPU-dependent kernel path ran in this pytest process"]:
        terminalreporter.write_line(f"- {line}")
