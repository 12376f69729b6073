"""The ``abstractdiff`` command line: ``abstractdiff check``."""

from __future__ import annotations

import argparse
import sys

from ._registry import registered_backends, unavailable_reason


def _check(args: argparse.Namespace) -> int:
    print("abstractdiff backends")
    for name in registered_backends():
        reason = unavailable_reason(name)
        status = "available" if reason is None else f"unavailable: {reason}"
        print(f"  {name:<20} {status}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="abstractdiff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="list backends and run the conformance report")
    check.set_defaults(run=_check)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
