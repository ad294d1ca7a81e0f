"""The ablation config: its dataclasses (`schema`), the checks of its grid entries (`grid`), loading it from
YAML with `--set` overrides (`load`), and its keys as `tomerge ablate --help` lists them (`help`); no side
effects. `tomerge.experiments.config.NAME` answers the names of these four modules."""

from typing import Any

from .. import forward_names

# Asked in this order; the last one's error is the one raised for a name none of them has.
_OWNERS = [forward_names(__name__, f"{__name__}.{module}") for module in ("schema", "load", "grid", "help")]


def __getattr__(name: str) -> Any:
    for forward in _OWNERS[:-1]:
        try:
            return forward(name)
        except AttributeError:
            pass
    return _OWNERS[-1](name)
