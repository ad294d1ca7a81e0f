"""The ablation config: its dataclasses (`schema`), the checks of its grid entries (`grid`), loading it from
YAML with `--set` overrides, which imports the plugins it names (`load`), and its keys as `tomerge ablate
--help` lists them (`help`). `tomerge.experiments.config.NAME` answers the names of these four modules."""

from .. import forward_names

__getattr__ = forward_names(__name__, *(f"{__name__}.{module}" for module in ("schema", "load", "grid", "help")))
