"""Turn any exception a command raises into one line and an exit code.

``dpmtv-site`` never shows a traceback for something the user typed or pointed at: a typed
dpmtv error, a pydantic validation error, a bad path, a file that is not UTF-8 all become one
line and exit code 2. Anything else is a bug or an environment fault: one line, exit code 1,
and the traceback under ``-v``.
"""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_settings import SettingsError

from dpmtv_common.errors import DpmtvError

__all__ = ["INPUT_ERROR", "UNEXPECTED_ERROR", "describe", "validation_line"]

INPUT_ERROR = 2
"""Exit code of a usage or input error (argparse uses 2 as well)."""
UNEXPECTED_ERROR = 1
"""Exit code of anything else."""

# OSErrors a user causes by naming a path; others (disk full, I/O error) are the machine's.
_PATH_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def validation_line(exc: ValidationError, *, options: dict[str, str] | None = None) -> str:
    """One line for a pydantic error: ``<field> must ...: <pydantic's reason>, got <input>``.

    ``options`` maps field names to the option the user typed (``budget_epsilon`` ->
    ``--budget-epsilon``), so the line names what the user can change.
    """
    names = options or {}
    parts = []
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"]) or exc.title
        shown = names.get(field, field)
        # Our own validators already say "x must ..., got ..."; pydantic's need the value.
        message = str(error["msg"]).removeprefix("Value error, ")
        if "got " not in message:
            message += f", got {error.get('input')!r}"
        parts.append(f"{shown}: {message}")
    return f"invalid {exc.title}: " + "; ".join(parts)


def describe(exc: Exception) -> tuple[int, str]:
    """Return the exit code and the one line that says what went wrong."""
    if isinstance(exc, ValidationError):
        return INPUT_ERROR, validation_line(exc)
    if isinstance(exc, DpmtvError | SettingsError):
        return INPUT_ERROR, _one_line(str(exc))
    if isinstance(exc, UnicodeDecodeError):
        return INPUT_ERROR, f"a file must be UTF-8 text, got undecodable bytes ({exc.reason})."
    if isinstance(exc, _PATH_ERRORS):
        return INPUT_ERROR, _one_line(str(exc))
    kind = type(exc).__name__
    return UNEXPECTED_ERROR, f"{kind}: {_one_line(str(exc))} (run with -v for the traceback)"


def _one_line(text: str) -> str:
    # Wrapped messages (pydantic's, a chained cause's) would break the one-line promise.
    return " ".join(text.split())
