"""Stand-in for `sgl_kernel.scalar_type` (see `sgl_kernel._not_built`).

SGLang reads `scalar_types.uint4b8` and friends at import time to build the
lists of weight types its GPTQ/AWQ/Marlin methods accept; as NotBuilt
attributes they are importable names, and using one as a type (its size,
bias) raises. No quantization method runs on the device (bf16 weights).
"""

from sgl_kernel._not_built import export

export(globals(), __name__, {"unquantized": ("ScalarType", "scalar_types")})
