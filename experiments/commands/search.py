"""`tomerge search`: its arguments and its flow."""

from ..runs.search import add_arguments, main, run  # noqa: F401
