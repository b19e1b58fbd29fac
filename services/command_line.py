"""The argument parser and exit-code mapping shared by every ``dartree`` entry point.

``dartree`` itself (:mod:`services.cli`) and the module entry points (``python -m services.serve``,
``python -m services.ray_serve``) use both, so bad input ends the same way everywhere: a one-line
``<prog>: error: ...`` message and exit status 2, never a usage block or a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.runtime import error_line


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``<prog>: error: <what> (see <prog> --help)``, exit code 2
    (argparse's own prints the whole usage block first, a screenful for ``generate``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """``func(args)`` as an exit code: its own (None = 0), 130 on Ctrl-C, 2 with a one-line
    ``dartree: error: ...`` for bad input (ValueError), a path problem (OSError: permissions, a full
    disk) or a refused start (RuntimeError). Before it runs, torch inductor's cache is pointed at the
    state directory (:func:`services.machine_cache.use_inductor_cache`; the workers inherit it), so
    compiled steps load on a restart."""
    from services.machine_cache import use_inductor_cache

    try:
        use_inductor_cache()
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        print(f"dartree: error: {error_line(e)}", file=sys.stderr)
        return 2
