"""The experiment layer: what `tomerge` runs, measures and draws.

One stage per folder, in the order a run takes them: ``errors`` and ``plugins``, ``sources/`` (what a run draws
from), ``config/``, ``generation/``, ``measure/``, ``runs/``, ``figures/``, ``bench/``, ``commands/`` and ``cli``. A
module imports only from its own stage and the stages before it, and no module is longer than 450 lines, which
``tests/experiments/test_experiments_layout.py`` checks. What each stage and module owns: docs/experiments.md,
"Layout: which module owns what".
"""
