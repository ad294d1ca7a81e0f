"""`tomerge generate`: its arguments and its flow."""

from ..generation.generate import add_arguments, main, run  # noqa: F401
