"""The ablation config: its dataclasses (`schema`), the checks of its grid entries (`grid`), loading it from
YAML with `--set` overrides, which imports the plugins it names (`load`), and its keys as `tomerge ablate
--help` lists them (`help`)."""
