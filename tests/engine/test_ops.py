"""engine/layers/ops.py is the one place that picks a C++ kernel or its plain-torch reference."""
import re
from pathlib import Path

import pytest
import torch

from cpuserve.engine.layers import native, ops
from cpuserve.engine.layers.attention import decode_mask

ENGINE = Path(__file__).resolve().parents[2] / "engine"
MODEL_CODE = [*sorted((ENGINE / "models").glob("*.py")), ENGINE / "distributed" / "sharding.py"]
# importing native.py or calling a torch.ops.cpuserve kernel: a kernel chosen outside ops.py
KERNEL_CHOICE = re.compile(r"^\s*from cpuserve\.engine\.layers import .*\bnative\b"
                           r"|layers\.native\b|torch\.ops\.cpuserve", re.MULTILINE)


@pytest.mark.parametrize("path", MODEL_CODE, ids=lambda p: p.name)
def test_model_code_calls_ops_not_kernels(path):
    found = KERNEL_CHOICE.findall(path.read_text())
    assert not found, f"{path.name} chooses kernels itself ({found}): call engine/layers/ops.py instead"


def test_the_check_sees_a_kernel_choice():
    assert KERNEL_CHOICE.search("from cpuserve.engine.layers import native\n")
    assert KERNEL_CHOICE.search("        y = torch.ops.cpuserve.rms_norm(x, w, eps)\n")
    assert not KERNEL_CHOICE.search("from cpuserve.engine.layers import ops\n")


def test_decode_mask_only_for_the_reference(monkeypatch):
    lens = torch.tensor([3, 17], dtype=torch.int32)
    monkeypatch.setattr(native, "enabled", lambda: True)
    assert ops.prepare_decode_mask(lens, 16) is None  # the kernel masks by context_lens itself
    monkeypatch.setattr(native, "enabled", lambda: False)
    assert torch.equal(ops.prepare_decode_mask(lens, 16), decode_mask(lens, 16))
