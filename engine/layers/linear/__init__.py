"""Weight-only quantized linear layers, one class per weight format behind build_linear (factory.py).

    base.py     QuantLinear: what every format shares (act dtype, bias, out=, input_buffer)
    dense.py    fp32 / bf16, and the dequantized fallback for shapes the int4 / int8 kernels refuse
    int4.py     group-wise RTN int4 in torch's int4pack layout, our GEMM or torch's
    int8.py     per-channel int8, our GEMM or torch's
    coded.py    CodedWeight: a GGUF tensor's own codes + group scales, kept by the int8-activation layers
    stacked.py  StackedLinear: a fused weight's row blocks of different storage, one int8-activation layer each
    factory.py  build_linear(weight, bias, fmt, group_size): validates and picks the class

The formats and group sizes are listed once, in engine/config.py (WEIGHT_FORMATS, GROUP_SIZES).
"""
from cpuserve.engine.layers.linear.base import QuantLinear
from cpuserve.engine.layers.linear.factory import build_linear

__all__ = ["QuantLinear", "build_linear"]
