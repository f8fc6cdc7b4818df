"""``pikv-hf`` command line: ``demo`` (a long document answered from full, routed and compressed KV; ``--tiny``:
exactness on a random MoE) and ``eval`` (quality harness)."""

from __future__ import annotations

import argparse
import sys

from pikv_hf.checks import CommandLineError


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except ``None`` (those options say in their help what they default
    to)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pikv-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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
