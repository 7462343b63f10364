"""The `dllama` command. Subcommands live in their own modules and are imported only when used,
so `dllama worker` on a Raspberry Pi never imports the root's dependencies."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from ..errors import DllamaError

SUBCOMMANDS = {
    "worker": "dllama.cli.worker_cmd:worker",
    "workers": "dllama.cli.workers_cmd:workers",
    "inference": "dllama.cli.generate_cmd:inference",
    "chat": "dllama.cli.generate_cmd:chat",
    "perplexity": "dllama.cli.generate_cmd:perplexity",
    "serve": "dllama.cli.serve_cmd:serve",
    "bench-sync": "dllama.cli.bench_sync_cmd:bench_sync",
    "models": "dllama.cli.models_cmd:models",
    "plan": "dllama.cli.plan_cmd:plan",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """dllama: run one LLM across several weak machines (tensor parallelism over TCP)."""
    # node failures and recoveries are logged as warnings: one line each, on stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # (click >= 8.2)


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors become one line on stderr and a non-zero exit (DLLAMA_DEBUG=1 shows
    the traceback of an unexpected one)."""
    try:
        code = cli.main(args=argv, standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.exit(130)
    except _NO_ARGS_IS_HELP as e:  # `dllama` alone: the help, as click shows it
        e.show()
        sys.exit(e.exit_code)
    except click.ClickException as e:  # a bad option etc.: click's own message, on one line like our errors
        ctx = getattr(e, "ctx", None)  # (a usage error's: which --help to read)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except DllamaError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:
        if os.environ.get("DLLAMA_DEBUG"):
            raise
        click.echo(f"error: {type(e).__name__}: {e} (set DLLAMA_DEBUG=1 for details)", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
