"""Speed benchmarks: kernels and planning (`kernels`), end-to-end widths (`e2e`), the CUDA allocator
settings (`allocator`) and the GPU script (`gpu.sh`). `tomerge.experiments.bench.NAME` answers the names
of `kernels`."""

from .. import forward_names

__getattr__ = forward_names(__name__, f"{__name__}.kernels")
