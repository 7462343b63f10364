"""`dllama worker`: the daemon a Raspberry Pi (or any node) runs. It needs no model file."""

from __future__ import annotations

import logging
import socket
import sys

import click

from ..cluster.slice_cache import default_cache_dir
from .common import fail, is_loopback, require_credential_off_loopback, run_async


@click.command()
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=9998, show_default=True, help="0 picks a free port.")
@click.option("--threads", "--nthreads", "-t", type=click.IntRange(1), default=None,
              help="Compute threads (default: all cores).")
@click.option("--secret", envvar="DLLAMA_SECRET", default=None,
              help="Shared secret: roots and peers must prove they know it (env DLLAMA_SECRET).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help=f"Where received weight slices are kept (default: {default_cache_dir()}).")
@click.option("--no-cache", is_flag=True, help="Keep slices in memory only.")
@click.option("--timeout", type=click.FloatRange(0.1), default=30.0, show_default=True,
              help="Seconds a silent peer is given before it is declared dead.")
@click.option("--max-memory", type=click.IntRange(1), default=None, metavar="MB",
              help="Refuse a slice (with its KV cache) larger than this (default: the available memory "
                   "less a margin).")
@click.option("--setup-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True, metavar="S",
              help="A root that connected must send its first request within S seconds (heartbeats do not count).")
@click.option("--insecure", is_flag=True,
              help="Allow a --host other than loopback without --secret (anyone who reaches the port may use it).")
@click.option("--advertise/--no-advertise", default=None,
              help="Announce this worker on the LAN by mDNS (_dllama._tcp) so `--workers auto` finds it "
                   "(default: on, unless --host is a loopback address).")
@click.option("--name", default=None, metavar="NAME",
              help="Node name in the advertisement and in `dllama workers` (default: the host name).")
@click.option("--quiet", "-q", is_flag=True, help="Log warnings only.")
def worker(host, port, threads, secret, cache_dir, no_cache, timeout, max_memory, setup_timeout, insecure,
           advertise, name, quiet):
    """Serve roots: receive a slice of the model, then run forward steps on command."""
    secret = secret or None  # DLLAMA_SECRET= (empty) means no secret
    if advertise and is_loopback(host):
        fail(f"--advertise: a worker on {host} cannot be reached from the network; give --host 0.0.0.0 or an "
             "address of this machine")
    advertise = not is_loopback(host) if advertise is None else advertise
    if name is not None and not advertise:
        fail("--name is the name this worker advertises: it needs advertising (a --host other than loopback)")
    require_credential_off_loopback(host, secret, insecure, what="secret", how="--secret S (or DLLAMA_SECRET)",
                                    whom="this worker")
    from ..cluster.worker import serve
    from ..kernels import set_threads

    # force: the command group already set a warnings-only handler, which hid the worker's log
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s worker %(message)s", datefmt="%H:%M:%S", force=True)
    threads = set_threads(threads)

    def announce(h, p):
        print(f"listening on {h}:{p}", flush=True)
        logging.getLogger("dllama.worker").info("listening on %s:%d with %d thread(s)", h, p, threads)

    run_async(serve(host, port, threads=threads, secret=secret,
                    cache_dir=None if no_cache else (cache_dir or default_cache_dir()), timeout=timeout,
                    max_memory=None if max_memory is None else max_memory * 1_000_000, setup_timeout=setup_timeout,
                    announce=announce, advertise_as=(name or socket.gethostname()) if advertise else None))
