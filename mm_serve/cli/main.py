"""Entry point of the ``mm-serve`` console script.

Each sub-command lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (a callable
taking the parsed ``argparse.Namespace`` and returning an exit status).
Sub-command modules import heavy dependencies (torch, transformers) lazily,
inside ``func``, so ``mm-serve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from mm_serve.ground.console import drop_output, say

# Sub-command modules, in the order ``--help`` lists them. A module that is not
# present yet (a feature still being built) is skipped.
_SUBCOMMAND_MODULES = (
    "mm_serve.cli.serve",
    "mm_serve.cli.generate",
    "mm_serve.cli.caption",
    "mm_serve.cli.bench",
    "mm_serve.cli.plan",
    "mm_serve.cli.profile",
)


class CLIError(Exception):
    """A user error: printed as ``mm-serve: error: <message>`` with exit status 2."""


class StopSignal(KeyboardInterrupt):
    """Raised by a command's SIGINT / SIGTERM handler so that the command unwinds (stopping what it
    started) as on Ctrl-C; :func:`main` catches it and exits with status 130.

    A subclass, not ``KeyboardInterrupt`` itself: when a bare ``KeyboardInterrupt`` leaves code that
    ``exec()`` runs from a string (``dataclasses`` and ``collections.namedtuple`` build their methods that
    way, so imports do it hundreds of times), CPython marks the process to kill itself with SIGINT at exit
    even after the exception was caught (``run_eval_code_obj`` in ``Python/pythonrun.c``); its check
    compares the exact type, so a subclass exits with the status ``main`` returns."""


def stop_on_signal(signum: int, frame: object) -> None:
    """A ``signal.signal`` handler: raise :class:`StopSignal` (the signal number is not kept: the
    exit status is 130 for SIGINT and SIGTERM alike)."""
    raise StopSignal


def _from_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while handling, or because of, a Ctrl-C or :class:`StopSignal`: a signal
    that lands inside transformers' lazy import leaves it as a ``ModuleNotFoundError`` whose context is
    the interrupt."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


class _Parser(argparse.ArgumentParser):
    """An argument error is one line, in the same format as every other user error
    (argparse would print the whole usage block first), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"mm-serve: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available sub-command (their parsers are
    of the same class, so their argument errors are one line too)."""
    parser = _Parser(
        prog="mm-serve",
        description="Multimodal LLM serving with prefill/decode disaggregation.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen sub-command; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        say(f"mm-serve: error: {exc}")
        return 2
    except KeyboardInterrupt:
        say("mm-serve: interrupted")
        return 130
    except BrokenPipeError:  # `mm-serve plan ... | head`: the reader left, nothing to report
        drop_output(sys.stdout)  # no second error at exit
        return 0
    except Exception as exc:
        if not _from_interrupt(exc):
            raise
        say("mm-serve: interrupted")  # a library turned the interrupt into its own error (a lazy import's)
        return 130


if __name__ == "__main__":  # `python -m mm_serve.cli.main`: run the package's module, so that
    # sub-commands raise the same CLIError class this catches (not a __main__ copy of it)
    from mm_serve.cli.main import main as _main

    sys.exit(_main())
