"""``pikv-hf`` command line: ``demo`` (a long document answered from full, routed and compressed KV; ``--tiny``:
exactness on a random MoE) and ``eval`` (quality harness)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pikv_hf.checks import CommandLineError

# values that read as negative numbers rather than options (argparse's own pattern misses -1e3, -inf and -nan); no
# option of pikv-hf looks like one
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one ``PROG: error: MESSAGE`` line on stderr and exit status 2, without the usage
    block, and that reads a negative number (:data:`NEGATIVE_NUMBER`) after an option as its value."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _CommandParser(_Parser):
    """The parser of a subcommand: arguments it does not know are its error (``pikv-hf CMD: error:``), not the
    top-level parser's."""

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except ``None`` (those options say in their help what they default
    to)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pikv-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    from pikv_hf.demo import add_arguments as demo_arguments

    demo_arguments(
        sub.add_parser(
            "demo",
            help="a planted fact in a long document, answered from full, routed and compressed KV",
            formatter_class=_DefaultsFormatter,
        )
    )

    from pikv_hf.eval import cli as eval_cli

    eval_cli.add_arguments(
        sub.add_parser(
            "eval", help="quality harness: RULER-style offline suite or LongBench", formatter_class=_DefaultsFormatter
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``pikv-hf``; bad input found before any work is one ``pikv-hf CMD: error:`` line and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from pikv_hf.demo import run_demo

            return run_demo(args)
        from pikv_hf.eval import cli as eval_cli

        return eval_cli.run(args)
    except CommandLineError as err:
        print(f"pikv-hf {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
