"""`tomerge train-reference`: its arguments and its flow."""

from ..sources.training import add_arguments, main, run  # noqa: F401
