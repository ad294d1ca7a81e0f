"""Paper figures and tables from run folders; reads `runs/` only, never runs a model. `make` draws every figure
and table of a set of run folders (`tomerge figures`), from `run_data` (a run folder as the figures read it),
`canvas` (what every figure shares), `tables` (the ablation table), `pareto` (speed vs quality), `schedules`,
`merge_maps`, `image_grids` and `videos`."""
