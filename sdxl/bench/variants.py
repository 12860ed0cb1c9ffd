"""The variants a GPU lease (`.device/run.sh`) measures against the baseline, at batch 4.

Each is one environment variable that changes how the program is compiled for a GPU, not what it
computes, in the order the lease tries them while its time lasts:

- `groupnorm-shifted`: SDXL_GROUP_NORM=shifted (`sdxl.models.layers.GroupNorm`), each GroupNorm's
  statistics from one read of its input instead of two; the images agree to float precision.
- `while-graphs`: XLA's command buffers (CUDA graphs) also for `while` loops and conditionals, so that
  a whole denoising step is one graph launch. XLA's default puts only runs of fusions, cuBLAS,
  cuDNN and custom calls in graphs, and launches a loop's body from the host every step.
- `cublas-gemm`: no Triton GEMM fusions (`--xla_gpu_enable_triton_gemm=false`): every matmul goes to
  cuBLAS, with its epilogue (bias, GEGLU's gate) as a fusion of its own.
- `xla-attention`: SDXL_ATTENTION=xla (`sdxl.models.attention`), what cuDNN's flash attention wins at
  full size.

XLA reads XLA_FLAGS once, when the backend starts, so each variant runs in its own process; a flag
this jaxlib does not know stops it at that start ("Unknown flag in XLA_FLAGS"), which the lease
checks before it spends a compile on it. On a CPU the GPU flags change nothing.

`python -m sdxl.bench.variants` prints them for the lease's script, one per line: name, variable and
value, tab-separated.
"""

from typing import NamedTuple


class Variant(NamedTuple):
    name: str
    variable: str
    value: str


COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"  # XLA's default set

VARIANTS = (
    Variant("groupnorm-shifted", "SDXL_GROUP_NORM", "shifted"),
    Variant("while-graphs", "XLA_FLAGS", f"--xla_gpu_enable_command_buffer={COMMAND_BUFFERS},WHILE,CONDITIONAL"),
    Variant("cublas-gemm", "XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false"),
    Variant("xla-attention", "SDXL_ATTENTION", "xla"),
)

if __name__ == "__main__":
    for variant in VARIANTS:
        print("\t".join(variant))
