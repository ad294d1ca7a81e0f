"""The ablation config: its schema (`schema`), loaded from YAML with `--set` overrides and validated
without side effects. `tomerge.experiments.config.NAME` answers the names of `schema`."""

from .. import forward_names

__getattr__ = forward_names(__name__, f"{__name__}.schema")
