"""The grid entries of a config (``{strategy, ratios or flop_speedups, options}``): every problem of an entry
(:func:`entry_problems`, for ``grid:`` and ``search.space``), and the ratios a strategy accepts with its
options (:func:`valid_ratios`)."""

from __future__ import annotations

from typing import Any

from ..errors import did_you_mean

__all__ = ["ENTRY_KEYS", "entry_problems", "valid_ratios"]


def _unknown_strategy(strategy: Any) -> str:
    import tomerge

    registered = tomerge.list_strategies()
    own = "a strategy in your own file: plugins: [FILE] or --plugin FILE"
    close = did_you_mean(str(strategy), registered)
    if close:
        return f"unknown strategy {strategy!r}{close} (registered: {registered}; {own})"
    return f"unknown strategy {strategy!r}; registered: {registered} ({own})"


def _check_run(strategy: str, ratio: Any, options: dict[str, Any], backbones: list[str] | None) -> None:
    import tomerge
    from tomerge.attach import check_options

    if strategy not in tomerge.list_strategies():
        raise ValueError(_unknown_strategy(strategy))
    check_options(strategy, ratio=ratio, backbones=backbones, **options)


def valid_ratios(strategy: str, options: dict[str, Any], backbones: list[str] | None = None) -> tuple[float, float]:
    """The smallest and largest of the ratios 0, 0.05, ..., 0.95 that the strategy accepts with ``options``
    (e.g. ``sdtm`` with a deviation needs ``ratio < 1 - deviation``; a centre ratio below the deviation is
    accepted, its curve clipped at 0); raises the strategy's own error at ratio 0.5 when it accepts none."""
    accepted = []
    for i in range(20):
        try:
            _check_run(strategy, i / 20, options, backbones)
            accepted.append(i / 20)
        except ValueError:
            pass
    if not accepted:
        _check_run(strategy, 0.5, options, backbones)
        raise ValueError(f"{strategy} accepts no ratio in [0, 0.95] with options {options}")
    return accepted[0], accepted[-1]


ENTRY_KEYS = ("strategy", "ratios", "flop_speedups", "options")
_ENTRY_SHAPE = "entries are {strategy, ratios or flop_speedups, options}"


def entry_problems(i: int, entry: Any, backbones: list[str] | None, prefix: str = "grid") -> list[str]:
    """Every problem of grid entry ``i``, one message each: its keys, its strategy, each unknown option
    (with the closest valid one), and each ratio (checked with the options that exist, so an unknown
    option does not hide a bad ratio), or its FLOP targets. Messages start with ``{prefix}[i]``."""
    if not isinstance(entry, dict):
        return [f"{prefix}[{i}]: {_ENTRY_SHAPE}; got {entry!r}"]
    problems = []
    unknown_keys = [k for k in entry if k not in ENTRY_KEYS]
    for key in unknown_keys:
        hint = did_you_mean(str(key), ENTRY_KEYS) or f"; {_ENTRY_SHAPE}"
        problems.append(f"{prefix}[{i}]: unknown entry key {key!r}{hint}")
    if "strategy" not in entry:
        return [*problems, f"{prefix}[{i}]: no strategy; {_ENTRY_SHAPE}; got {entry}"]
    strategy = entry["strategy"]
    where = f"{prefix}[{i}] ({strategy})"
    import tomerge

    known = isinstance(strategy, str) and strategy in tomerge.list_strategies()
    if not known:
        problems.append(f"{where}: {_unknown_strategy(strategy)}")
    if ("ratios" in entry) == ("flop_speedups" in entry):
        if "ratios" in entry:
            problems.append(f"{where}: give ratios or flop_speedups, not both; {_ENTRY_SHAPE}; got {entry}")
        elif not any(did_you_mean(str(k), ("ratios", "flop_speedups")) for k in unknown_keys):
            problems.append(f"{where}: no ratios: [...] or flop_speedups: [...]; {_ENTRY_SHAPE}; got {entry}")
        return problems
    key = "ratios" if "ratios" in entry else "flop_speedups"
    values = entry[key]
    if not isinstance(values, (list, tuple)) or not values:
        problems.append(f"{where}: {key} must be a non-empty list, got {values!r}")
        values = []
    options = entry.get("options") or {}
    if not isinstance(options, dict):
        problems.append(f"{where}: options must be a mapping {{option: value}}, got {options!r}")
        options = {}
    if not known:
        return problems
    from tomerge.attach import option_names
    from tomerge.context import check_ratio

    valid = option_names(strategy, backbones)
    for name in [k for k in options if k not in valid]:
        problems.append(f"{where}: unknown option {name!r} for strategy {strategy!r}"
                        f"{did_you_mean(str(name), valid) or f'; valid options: {valid}'}")
    options = {k: v for k, v in options.items() if k in valid}
    errors = (ValueError, TypeError, KeyError)
    if key == "flop_speedups":
        bad = [t for t in values if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 1]
        if bad:
            problems.append(f"{where}: flop_speedups are FLOP-ideal speed-up targets > 1, got {bad}")
        try:
            valid_ratios(strategy, options, backbones)
        except errors as err:
            problems.append(f"{where}: {_message(err)}")
        return problems
    failures: dict[str, list[Any]] = {}  # a message -> the ratios it holds for, in order
    in_range = []
    for ratio in values:
        try:
            _check_run(strategy, ratio, options, backbones)
            in_range.append(ratio)
            continue
        except errors as err:
            message = _message(err)
        try:
            check_ratio(ratio)
            in_range.append(ratio)
        except ValueError as err:
            message = _message(err)  # the ratio itself, whatever the options
        failures.setdefault(message, []).append(ratio)
    if values and not in_range:  # the options' own values are still checked, at ratio 0
        try:
            _check_run(strategy, 0.0, options, backbones)
        except errors as err:
            problems.append(f"{where}: {_message(err)}")
    for message, ratios in failures.items():
        at = f"ratio {ratios[0]}" if len(ratios) == 1 else f"ratios {', '.join(str(r) for r in ratios)}"
        problems.append(f"{prefix}[{i}] ({strategy} at {at}): {message}")
    return problems


def _message(err: BaseException) -> str:
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
