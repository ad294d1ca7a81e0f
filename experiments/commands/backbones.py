"""`tomerge backbones`: which diffusers model classes tomerge merges, as a text table, JSON lines or the
Markdown page (:mod:`tomerge.experiments.sources.coverage` builds the table)."""

from __future__ import annotations

import argparse

from ..sources.coverage import PAGE, REGENERATE, coverage, json_lines, markdown, text_table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object per class (keys class, backbone, "
                      "strategies, reason, grid_dims, kinds, module, diffusers)")
    form.add_argument("--markdown", action="store_true", help=f"the page {PAGE} ({REGENERATE})")


def run(args: argparse.Namespace) -> int:
    table = coverage()
    print(json_lines(table) if args.json else markdown(table) if args.markdown else text_table(table),
          end="" if args.markdown else "\n")
    return 0
