"""`tomerge figures`: its arguments and its flow."""

from ..figures.plots import add_arguments, main, run  # noqa: F401
