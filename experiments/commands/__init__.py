"""One file per ``tomerge`` subcommand, each a thin ``main`` over library code: ``add_arguments(parser)`` (its
options), ``run(args) -> exit code`` (its flow), and ``main(argv)`` for ``python -m
tomerge.experiments.commands.NAME``. ``tomerge.experiments.cli`` wires them together."""
