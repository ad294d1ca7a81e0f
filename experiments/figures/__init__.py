"""Paper figures and tables from run folders (`plots`) and Pareto fronts (`pareto`); reads `runs/`
only. `tomerge.experiments.figures.NAME` answers the names of `plots`."""

from .. import forward_names

__getattr__ = forward_names(__name__, f"{__name__}.plots")
