"""The `stare-agent` command line. Each subcommand imports what it needs lazily so that
`stare-agent sandbox doctor` works even where torch is broken."""

from __future__ import annotations

import argparse
import sys


def _sandbox_build(args: argparse.Namespace) -> int:
    from sandbox.build import build_image, image_exists

    if image_exists(args.tag) and not args.force:
        print(f"sandbox image {args.tag} present (use --force to rebuild)")
        return 0
    build_image(args.tag, force=args.force)
    return 0


def _sandbox_doctor(args: argparse.Namespace) -> int:
    from sandbox.doctor import diagnose

    failed = 0
    for check in diagnose():
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.message}")
        failed += not check.ok
    return 1 if failed else 0


def _sandbox_demo(args: argparse.Namespace) -> int:
    from sandbox import make_sandbox

    cells = [
        "import sympy as sp\nn = 2**127 - 1\nsp.isprime(n)",
        "x = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
        "n % 1000",
        "1 / 0",
    ]
    with make_sandbox(args.backend) as sb:
        print(f"backend: {sb.backend}")
        for code in cells:
            result = sb.run(code)
            shown = result.stdout.strip() or (f"{result.error.type}: {result.error.message}" if result.error else "")
            print(f">>> {code.splitlines()[-1]}\n{shown}   [{result.duration_s * 1000:.1f} ms]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stare-agent", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sandbox = sub.add_parser("sandbox", help="build, check or try the code sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    from sandbox.config import DEFAULT_IMAGE

    p = sandbox_sub.add_parser("build", help="build the sandbox image from Debian packages")
    p.add_argument("--tag", default=DEFAULT_IMAGE)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.set_defaults(func=_sandbox_build)
    p = sandbox_sub.add_parser("doctor", help="check daemon, image and permissions; one line per problem")
    p.set_defaults(func=_sandbox_doctor)
    p = sandbox_sub.add_parser("demo", help="run a few cells in a sandbox")
    p.add_argument("--backend", default="auto", choices=["auto", "docker", "local"])
    p.set_defaults(func=_sandbox_demo)

    p = sub.add_parser("quickstart", help="the main job on the embedded default model")
    p.add_argument("--backend", default="auto", choices=["auto", "docker", "local"])
    p.set_defaults(func=_sandbox_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
