"""Stand-in for `sgl_kernel.utils`: one capability query, answered.

`is_arch_support_pdl` is the only name of the stand-in that executes: SGLang's
Triton attention backend asks it once at construction whether to launch its
kernels with programmatic dependent launch (PDL). sgl-kernel's own answers
"compute capability >= 9"; this one answers False: no PDL launches. That is
this build's truth (no sgl-kernel, and the image's Triton 3.6 is older than the
3.9 SGLang pairs with), and SGLang's kernels without PDL compute the same
result, only without overlapping a kernel's prologue with the previous one.
"""


def is_arch_support_pdl() -> bool:
    return False
