"""Building a settings object from command-line options over the environment, with one-line errors."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from adaserve.cli_error import CliError

S = TypeVar("S", bound=BaseModel)


def load(cls: type[S], given: dict[str, Any], *, options: tuple[str, ...], env_prefix: str) -> S:
    """``cls(**given)``; a bad value becomes CliError naming the option and the environment variable."""
    try:
        return cls(**given)
    except SettingsError as e:  # an environment value that is not even JSON
        cause = f": {e.__cause__}" if e.__cause__ else ""
        raise CliError(f"{e}{cause}") from None
    except ValidationError as e:
        raise CliError("; ".join(describe(err, options=options, env_prefix=env_prefix)
                                 for err in e.errors())) from None


def describe(err: Any, *, options: tuple[str, ...], env_prefix: str) -> str:
    """One validation error as 'field (--option or PREFIX_FIELD): message'."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    name = str(err["loc"][0])
    where = f"{env_prefix}{name.upper()}"
    if name in options:
        where = f"--{name.replace('_', '-')} or {where}"
    return f"{'.'.join(map(str, err['loc']))} ({where}): {msg}"
