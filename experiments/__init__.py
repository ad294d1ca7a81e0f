"""The experiment layer: what `tomerge` runs, measures and draws. One stage per folder; a module imports only
from its own stage and the stages before it, and no module is longer than 450 lines, which
``tests/experiments/test_experiments_layout.py`` checks (docs/experiments.md, "Layout: which module owns what"):

=============== ==========================================================================================
``errors``      every user-facing error class and how the command line reports them
``plugins``     ``--plugin MODULE_OR_FILE`` and ``plugins:`` in a config: one-file strategies and backbones
``sources/``    what a run draws from: items (prompts or classes -> seeds), prompt sets, Fashion-MNIST, the
                reference DiT, its sampler and trainer, diffusers pipelines, local metric weights, the
                backbone coverage table
``config/``     the ablation config: schema (plain dataclasses), loading with ``--set`` overrides (it imports
                the ``plugins:`` the config names: its grid names their strategies), validation
``generation/`` images and videos for a list of items, in one process or with Lightning DDP; their files
                (written and read) and the pictures drawn from them
``measure/``    one timer, one FLOP counter, quality metrics and feature extractors, the one table of
                result columns (what each number is called and which way is better)
``runs/``       the run folder (written and read), and what fills run folders: the ablation and the search
``figures/``    plots and tables from run folders (reads ``runs/`` only, never runs a model)
``bench/``      kernel and end-to-end speed benchmarks, the GPU script
``commands/``   one thin file per ``tomerge`` subcommand: its arguments and its flow
``cli``         the ``tomerge`` entry point, wiring the commands together
=============== ==========================================================================================
"""
