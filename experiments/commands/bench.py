"""`tomerge bench`: its arguments and its flow."""

from ..bench.kernels import add_arguments, main, run  # noqa: F401
