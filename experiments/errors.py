"""Every user-facing error of the `tomerge` commands, and how the command line reports them.

A mistake of the user's (a :class:`UserError` such as :class:`ConfigError` or :class:`DiskFullError`, a missing
file, a full disk, a bad value read inside :func:`user_input`) prints ``tomerge COMMAND: error: MESSAGE`` and
exits with 2, without a traceback (:func:`report_errors`); anything else is a bug (traceback, exit 1); Ctrl-C
exits with 130 saying that a rerun resumes. The rules: docs/experiments.md, "3. Run the ablation", Errors.

This module imports nothing of tomerge: every other module may import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator

__all__ = ["UserError", "UsageError", "ConfigError", "PluginError", "MissingWeightsError", "DiskFullError",
           "DamagedFileError", "FolderInUseError", "RankFailedError", "NO_SPACE", "is_disk_full", "is_user_error",
           "user_input", "did_you_mean", "INTERRUPTED", "report_errors", "module_main"]

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})  # the errno of a full disk and of a used-up quota

# What an interrupted command leaves behind (printed after "interrupted; ").
INTERRUPTED = {
    "ablate": "finished runs and images are kept, rerun the same command to resume",
    "generate": "finished images are kept, rerun the same command to resume",
    "search": "finished trials are kept, rerun the same command to resume",
    "train-reference": "the last checkpoint is kept, rerun the same command with --resume to continue",
}


# ------------------------------------------------------------------------------------ the errors
class UserError(Exception):
    """An error the user fixes (a config, an argument, a file): the command line reports its message in
    one line (no traceback) and exits with 2. Every error class of this module is one."""


class UsageError(UserError, ValueError):
    """A bad value or a refused request (a ``ValueError``), e.g. an output folder holding images made
    with other settings."""


class ConfigError(UsageError):
    """Everything wrong with a config, one problem per line (``problems``); a ``ValueError``, reported by
    the command line without a traceback."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the config has {len(self.problems)} problem(s):\n{lines}")


class PluginError(UserError, ImportError):
    """A plugin could not be loaded; ``plugin`` is the spec as given (a user error: one line on the
    command line)."""

    def __init__(self, message: str, plugin: str) -> None:
        super().__init__(message)
        self.plugin = plugin


class MissingWeightsError(UserError, FileNotFoundError):
    """A metric needs local weights that were not given or do not exist; the message names the option."""


class DiskFullError(UserError, OSError):
    """No space left on the device (or the quota is used up) while writing a file (an ``OSError`` with
    that ``errno``, whose message names the file and what to do)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # one line, without OSError's "[Errno 28]"


class DamagedFileError(UserError):
    """A file of a run folder cannot be read (truncated, not what it should be, written by another
    version); the message says which file (and line) and what to do."""


class FolderInUseError(UserError):
    """Another process holds the folder's lock."""


class RankFailedError(UserError):
    """A rank of a distributed generation died (killed, out of memory) or failed with a user error; the
    other ranks were stopped. Not a bug in tomerge: the message says which rank and how, and that a rerun
    resumes."""


# ------------------------------------------------------------------------------------ telling them apart
def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` of a full disk or a used-up quota (:data:`NO_SPACE`)."""
    return isinstance(err, OSError) and err.errno in NO_SPACE


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is reported in one line (see the module docstring)."""
    return isinstance(err, (UserError, FileNotFoundError)) or is_disk_full(err)


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Marks config and argument handling: a ``ValueError``, ``TypeError`` or ``KeyError`` raised inside
    is the user's, re-raised as :class:`UsageError` (the original chained; user errors pass unchanged).

    Example:
        >>> with user_input():                             # doctest: +SKIP
        ...     config = load_config(args.config, args.overrides)
    """
    try:
        yield
    except UserError:
        raise
    except (ValueError, TypeError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and len(err.args) == 1 else str(err)
        raise UsageError(str(message)) from err


def did_you_mean(word: str, choices: Iterable[str], quote: Callable[[str], str] = repr) -> str:
    """``"; did you mean 'X'?"`` for the choice closest to ``word`` (:func:`difflib.get_close_matches`),
    ``""`` when none is close: the end of an "unknown ..." message.

    Example:
        >>> did_you_mean("per_clas", ["per_class", "seed"]), did_you_mean("zzz", ["per_class"])
        ("; did you mean 'per_class'?", '')
    """
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean {quote(close[0])}?" if close else ""


# ------------------------------------------------------------------------------------ reporting them
def report_errors(command: str, call: Callable[[], int], debug: bool = False) -> int:
    """``call()``'s exit code, with errors reported as the module docstring says (``debug``: re-raised)."""
    prog = f"tomerge {command}" if command else "tomerge"
    try:
        return call()
    except KeyboardInterrupt:
        if debug:
            raise
        kept = INTERRUPTED.get(command)
        print(f"\n{prog}: interrupted{f'; {kept}' if kept else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if debug:
            raise
        with contextlib.suppress(OSError, ValueError):  # stdout to /dev/null: the exit's flush fails no more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:
        if debug:
            raise
        if is_user_error(err):
            print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"{prog}: internal error ({type(err).__name__}): this is a bug in tomerge or in a plugin; please "
              "report it with the traceback above and the command line (--debug shows every traceback)",
              file=sys.stderr)
        return 1


def module_main(command: str, main: Callable[[], int]) -> None:
    """``python -m tomerge.experiments.MODULE``: ``main()`` with errors reported as by ``tomerge`` (whose
    ``--debug`` shows the tracebacks)."""
    sys.exit(report_errors(command, main))
