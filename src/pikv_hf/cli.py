"""``pikv-hf`` command line: ``demo`` (exactness + memory + speed on a tiny MoE) and ``eval`` (quality harness)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from pikv_hf.routing import PLACEMENTS
    from pikv_hf.tiny import TINY_ARCHS

    parser = argparse.ArgumentParser(prog="pikv-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="DynamicCache vs PiKVCache on an embedded tiny MoE model (no download)")
    demo.add_argument("--arch", default="mixtral", choices=list(TINY_ARCHS), help="tiny architecture to build")
    demo.add_argument("--router", default="expert", choices=PLACEMENTS, help="placement router")
    demo.add_argument("--prompt-len", type=int, default=256)
    demo.add_argument("--new-tokens", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)

    from pikv_hf.eval import cli as eval_cli

    eval_cli.add_arguments(sub.add_parser("eval", help="quality harness: RULER-style offline suite or LongBench"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from pikv_hf.demo import run_demo

        return run_demo(args)
    from pikv_hf.eval import cli as eval_cli

    return eval_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
