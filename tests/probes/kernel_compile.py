"""Every Triton kernel of verl_dppo.math.kernels compiles for an H100 (sm_90) on this CPU, no GPU needed: Triton's
own ptxas builds the cubin ahead of time. Run by tests/test_kernels.py in a child process with Triton on PYTHONPATH
and without TRITON_INTERPRET (the interpreter runs kernels, it does not compile them). The GPU image has Triton 3.6,
this machine 3.9: a kernel that compiles here may still meet an older Triton's limits, which bench/gpu_suite.py
shows on a lent GPU."""

from __future__ import annotations

import os
import time

import triton
from triton.backends.compiler import GPUTarget

from verl_dppo.math import kernels

POINTERS = {
    "logits_ptr": "*bf16",
    "rows_ptr": "*i64",
    "excluded_ptr": "*i64",
    "count_ptr": "*i32",
    "candidates_ptr": "*i32",
}  # every other pointer: float32
WIDE = {"stride_row", "stride_out"}  # int64 arguments; every other scalar: int32
CONSTANTS = {"HAS_ROWS": True, "HAS_MAX": False, "SUMS": False, "BLOCK": 1024}
VARIANTS = ({"ENTROPY": False}, {"ENTROPY": True})  # the kernels with an entropy flag compile both ways
SUMS = {"ENTROPY": True, "SUMS": True}  # and with the entropy's sums stored as they are, where a kernel can


def signature(fn, variant):
    types = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = POINTERS.get(name, "*fp32")
        else:
            types[name] = "i64" if name in WIDE else "i32"
    constants = {**CONSTANTS, **variant}
    return types, {name: constants[name] for name, kind in types.items() if kind == "constexpr"}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET: this compiles"
    target = GPUTarget("cuda", 90, 32)
    for fn in kernels._kernels():
        flagged = any(param.name == "ENTROPY" for param in fn.params)
        has_sums = any(param.name == "SUMS" for param in fn.params)
        for variant in (*VARIANTS, *((SUMS,) if has_sums else ())) if flagged else ({},):
            start = time.perf_counter()
            types, constants = signature(fn, variant)
            source = triton.compiler.ASTSource(fn=fn, signature=types, constexprs=constants)
            compiled = triton.compile(source, target=target, options={"num_warps": kernels._WARPS})
            assert compiled.asm["cubin"], fn.__name__
            print(
                f"{fn.__name__}{variant or ''}: sm_90 cubin of {len(compiled.asm['cubin'])} bytes in "
                f"{time.perf_counter() - start:.1f} s"
            )
    print(f"kernel compile: all kernels compile for sm_90 with Triton {triton.__version__}")
