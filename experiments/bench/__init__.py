"""Speed benchmarks: merge kernels on bare tensors (`kernels`, ``--kernels``), model forwards end to end
(`e2e`, ``--e2e``, on the random-weight models of `models`), the generation calls of a config's grid (`grid`,
``--config``), the malloc setting of CPU timings (`allocator`) and the GPU script (`gpu.sh`); the command line
is :mod:`tomerge.experiments.commands.bench`."""
