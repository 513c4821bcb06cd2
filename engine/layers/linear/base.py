"""What every weight format's linear layer shares: activation dtype, bias, out=, prompt rows and input_buffer.

    QuantLinear                 forward(x, out=, prompt_rows=): dtype cast, out= checked, rows [M, K] handed to the
                                format (prompt rows to its prompt kernel, if it has one)
    ├── DenseLinear (dense.py)  fp32 / bf16, and the fallback of int4 / int8 shapes the kernels refuse: our
    │                           dense_gemm, prompt rows on F.linear (its prompt kernel)
    └── PackedLinear            a packed weight through a C++ GEMM (ours, with out=, else torch's, without)
        ├── Int4Linear (int4.py)
        └── Int8Linear (int8.py)

factory.py's build_linear picks the class for a weight format.

Prompt rows: a layer may compute the rows that are prompt tokens in another scheme than the rest (Int8ActLinear on
AMX-BF16: bf16 activations instead of int8 ones; DenseLinear: torch's F.linear instead of dense_gemm). The runner
names those rows per step (AttentionMetadata.prompt_rows, from each row's role, never from the batch's size), so
which scheme computes a row depends on its role alone:

    rows  | decode | decode | prompt chunk a | b's recompute: prompt | b: generated | prompt chunk c |
    path  |      usual      |            prompt kernel               |    usual     | prompt kernel  |
"""
from __future__ import annotations

import torch
from torch import Tensor

RowRanges = tuple[tuple[int, int], ...]  # [start, stop) ranges of rows


class QuantLinear(torch.nn.Module):
    """y = x @ W.T + b with W stored as int4 / int8 / bf16 / fp32. Build with `build_linear`."""

    def __init__(self, in_features: int, out_features: int, fmt: str, group_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.group_size = fmt, group_size
        self.act_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        self.is_fallback = False
        self.register_buffer("bias", None)

    def forward(self, x: Tensor, out: Tensor | None = None, prompt_rows: RowRanges = ()) -> Tensor:
        """x [..., K] -> [..., N] in act_dtype (bf16 for int4/int8/bf16, fp32 for fp32).

        Args:
            out: a contiguous [..., N] act_dtype tensor to write the result into (a replica group's shared-memory
                slot: Communicator.next_buffer); returned. The same bits as without it.
            prompt_rows: sorted, disjoint [start, stop) ranges of the rows of x flattened to [M, K] that are prompt
                tokens (AttentionMetadata.prompt_rows). Where the layer has a prompt kernel (has_prompt_kernel) they
                are computed by it and the other rows by the usual path, each range a slice of x's rows and out's
                (no copies); else ignored.
        """
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        split = bool(prompt_rows) and self.has_prompt_kernel()
        if out is None and not split:
            return self._forward(x)
        lead = x.shape[:-1]
        if out is None:
            out = torch.empty((*lead, self.out_features), dtype=self.act_dtype)
        elif out.shape != (*lead, self.out_features) or out.dtype != self.act_dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.act_dtype} tensor of shape {(*lead, self.out_features)}, "
                             f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
        x2 = self._rows(x)  # x2: [M, K]
        y = out.view(-1, self.out_features)  # y: [M, N], out's memory
        if split:
            self._forward_split_into(x2, y, prompt_rows)
        else:
            self._usual_into(x2, y)
        return out

    def has_prompt_kernel(self) -> bool:
        """The layer computes prompt rows in a scheme of their own (_prompt_gemm_into); False: one path for all."""
        return False

    def has_prompt_silu_kernel(self) -> bool:
        """The prompt kernel also computes silu(gate) * up of a [gate | up] layer (an MLP's gate_up), without the
        [M, N] output in between (_prompt_silu_into); see silu_mul_into."""
        return False

    def silu_mul_into(self, x: Tensor, act: Tensor, prompt_rows: RowRanges) -> Tensor:
        """silu(gate) * up of this [gate | up] layer's output into act [M, N / 2] (only where has_prompt_silu_kernel):
        the bits of ops.silu_mul over forward(x, prompt_rows=). The prompt rows take the fused kernel, the others
        forward then silu_mul. Returns act."""
        x2 = self._rows(x if x.dtype == self.act_dtype else x.to(self.act_dtype))  # x2: [M, K]
        m = x2.shape[0]
        row = 0
        for start, stop in (*prompt_rows, (m, m)):
            assert row <= start <= stop <= m, f"prompt_rows {prompt_rows} are not sorted disjoint ranges of {m} rows"
            if start > row:
                gate_up = torch.empty((start - row, self.out_features), dtype=self.act_dtype)
                self._usual_into(x2[row:start], gate_up)
                torch.ops.cpuserve.silu_mul.out(gate_up, out=act[row:start])
            if stop > start:
                self._prompt_silu_into(x2[start:stop], act[start:stop])
            row = stop
        return act

    def _prompt_silu_into(self, x2: Tensor, act: Tensor) -> None:
        """The fused prompt kernel (only where has_prompt_silu_kernel): x2 [M, K] -> act [M, N / 2]."""
        raise NotImplementedError

    def input_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor [rows, in_features] to build this layer's next input in (a replica group's sharded layers
        hand out their collective's shared-memory slot instead)."""
        return torch.empty((rows, self.in_features), dtype=dtype)

    def can_write_into(self, rows: int) -> bool:
        """forward(x, out=) of this many rows computes straight into out; else (torch's int4 / int8 kernels, which
        have no out=, where ours are not built) into a new tensor that is then copied. The same at any number of
        rows today; callers ask per size so that a kernel without out= at some sizes could come back."""
        raise NotImplementedError

    def dequantize(self) -> Tensor:
        """The fp32 [N, K] weight this module effectively multiplies by (tests and reference only)."""
        raise NotImplementedError

    def _forward(self, x: Tensor) -> Tensor:
        """x [..., K] in act_dtype -> a new [..., N]."""
        raise NotImplementedError

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        """x2 [M, K] contiguous -> y [M, N], in place (only where can_write_into)."""
        raise NotImplementedError

    def _prompt_gemm_into(self, x2: Tensor, y: Tensor) -> None:
        """The prompt kernel (only where has_prompt_kernel): x2 [M, K] contiguous -> y [M, N], without bias."""
        raise NotImplementedError

    def _usual_into(self, x2: Tensor, y: Tensor) -> None:
        """x2 [M, K] -> y [M, N] by the usual path."""
        if self.can_write_into(x2.shape[0]):
            self._forward_into(x2, y)
        else:  # torch's kernel (ours are not built here): one copy
            y.copy_(self._forward(x2))

    def _forward_split_into(self, x2: Tensor, y: Tensor, prompt_rows: RowRanges) -> None:
        """The rows in prompt_rows through the prompt kernel, the rows before, between and after them the usual way."""
        m = x2.shape[0]
        row = 0
        for start, stop in (*prompt_rows, (m, m)):
            assert row <= start <= stop <= m, f"prompt_rows {prompt_rows} are not sorted disjoint ranges of {m} rows"
            if start > row:
                self._usual_into(x2[row:start], y[row:start])
            if stop > start:
                self._prompt_gemm_into(x2[start:stop], y[start:stop])
                if self.bias is not None:
                    y[start:stop] += self.bias
            row = stop

    def _rows(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)  # x2: [M, K]
        return x2 if x2.is_contiguous() else x2.contiguous()

    def extra_repr(self) -> str:
        path = "fallback" if self.is_fallback else "fast"
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, group={self.group_size}, {path}"


class PackedLinear(QuantLinear):
    """int4 / int8: our C++ GEMM (engine/csrc, with out=) when it is built and checked, else torch's kernel
    (no out=): the same bits. A format supplies the kernel calls."""

    def can_write_into(self, rows: int) -> bool:
        return self._own_kernel()

    def _forward(self, x: Tensor) -> Tensor:
        y = self._gemm(self._rows(x), self._own_kernel())  # y: [M, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)  # y: [..., N]

    def _forward_into(self, x2: Tensor, y: Tensor) -> None:
        self._gemm_into(x2, y)
        if self.bias is not None:
            y += self.bias

    def _own_kernel(self) -> bool:
        """Our GEMM runs (native.py built it and checked it against torch's), else torch's."""
        raise NotImplementedError

    def _gemm(self, x2: Tensor, own: bool) -> Tensor:
        """x2 [M, K] bf16 -> a new [M, N] bf16, without bias: ours if own, else torch's kernel."""
        raise NotImplementedError

    def _gemm_into(self, x2: Tensor, y: Tensor) -> None:
        """Our GEMM's out= variant: x2 [M, K] -> y [M, N], without bias."""
        raise NotImplementedError
