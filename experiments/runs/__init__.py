"""The run folder, written and read (`records`), and what fills run folders: the ablation grid (`ablation`)
and the search (`search`)."""
