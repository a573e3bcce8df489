"""The `miles` entry point. Parses flags and reports usage errors before torch is imported."""

from __future__ import annotations

import argparse
import shlex
import sys

from miles import __version__
from miles.errors import CheckFailed, RunFailed, Stopped, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    from miles.cli import train
    from miles.debug import chat_template, check_weights, diff_runs, inspect_rollout, selftest
    from miles.debug import doctor, report
    from miles.serve import cli as serve

    parser = _Parser(prog="miles", description="RL post-training of LLMs (GRPO family) with the debugging "
                                              "workflow built in.")
    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    train.register(commands)
    serve.register(commands)
    inspect_rollout.register(commands)
    check_weights.register(commands)
    chat_template.register(commands)
    diff_runs.register(commands)
    selftest.register(commands)
    report.register(commands)
    doctor.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    rc = 1  # the exit status if stdout's reader goes away before the command has finished
    try:
        parser = build_parser()
        argv = sys.argv[1:] if argv is None else list(argv)
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # name the subcommand's help, not the top-level one
            where = f"miles {args.command}" if args.command else "miles"
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (see `{where} --help`)")
        args.command_line = "miles " + shlex.join(argv)
        if args.command is None:
            parser.print_help()
            rc = 2
        else:
            rc = args.run(args) or 0
        sys.stdout.flush()  # a reader that went away shows here, inside this try, not at exit
        return rc
    except BrokenPipeError:  # stdout's reader closed early (`miles ... | head`): stop quietly
        import os

        # Python docs, "Note on SIGPIPE": point stdout at devnull so the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return rc
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:  # SIGTERM / SIGINT during `miles train`; train.log says what was saved
        print(f"stopped by {e.signal_name}" + (" (immediately, mid-step)" if e.immediate else ""), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
