"""The package layout (README.md, "Layout"; docs/index.md, "Architecture"): the core imports no plugin or model library;
plugins resolve from the top-level folders through the package_dir mapping and register by entry points."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import tomerge
from helpers import ROOT



def test_importing_the_core_loads_no_strategy_backbone_diffusers_or_timm():
    code = ("import sys, tomerge; bad = [m for m in sys.modules if m.split('.')[0] in ('diffusers', 'timm') "
            "or m.startswith(('tomerge.strategies', 'tomerge.backbones', 'tomerge.experiments'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_plugins_live_in_the_top_level_folders_and_register_by_entry_points():
    import tomerge.backbones.unet
    import tomerge.strategies.ssm

    assert Path(tomerge.strategies.ssm.__file__).resolve() == ROOT / "strategies" / "ssm.py"
    assert Path(tomerge.backbones.unet.__file__).resolve() == ROOT / "backbones" / "unet.py"
    strategies = {ep.name for ep in entry_points(group="tomerge.strategies")}
    backbones = {ep.name for ep in entry_points(group="tomerge.backbones")}
    assert {"tomesd", "ssm", "idm", "facility_location", "sdtm", "toma"} <= strategies <= set(tomerge.list_strategies())
    assert {"unet", "sd3", "flux", "pixart", "dit", "native_dit"} <= backbones <= set(tomerge.list_backbones())
