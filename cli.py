"""The ``softq`` command line: one subcommand per job, each defined next to its code.

Every ``softq.<part>.cli`` module exposes ``register(subparsers)``; heavy imports
happen inside the handlers so ``softq --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands; a part that is not installed yet is skipped.
SUBCOMMAND_MODULES = ("softq.quant.cli", "softq.export.cli", "softq.export.generate_cli", "softq.mpc.cli")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def calib_size_kwargs(args: argparse.Namespace) -> dict[str, int]:
    """``--calib-size`` when given, else nothing: the task's own default (``model_dir_task``: 64 of a --calib
    file, else its 132 built-in texts), the same for ``softq quantize`` and ``softq export``."""
    return {} if args.calib_size is None else {"calib_size": args.calib_size}


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="softq",
        description="Quantize, export and privately run softmax-sensitive transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_handler(build_parser(), argv)


def run_handler(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand's handler; an error is one line on stderr and exit code 1."""
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (ValueError, OSError, RuntimeError, ImportError) as err:  # OSError: FileNotFoundError, PermissionError, ...
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
