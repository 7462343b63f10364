"""`dllama workers`: the workers advertised on the LAN (mDNS), and whether this node would use them."""

from __future__ import annotations

import json

import click

from .common import DISCOVER_TIMEOUT, run_async


@click.command()
@click.option("--discover-timeout", type=click.FloatRange(0.1), default=DISCOVER_TIMEOUT, show_default=True,
              metavar="S", help="How long to listen for advertisements.")
@click.option("--secret", envvar="DLLAMA_SECRET", default=None,
              help="The secret a root would use (env DLLAMA_SECRET): decides which workers it could use.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per worker.")
def workers(discover_timeout, secret, as_json):
    """List the dllama workers visible on the network: name, address, protocol version, secret,
    threads, free memory, and whether `--workers auto` with this --secret would use them."""
    from ..net.discovery import discover

    secret = secret or None
    found = run_async(discover(discover_timeout))
    if as_json:
        click.echo(json.dumps([{**ad.to_json(), "usable": ad.unusable_reason(secret) is None,
                                "why_not": ad.unusable_reason(secret)} for ad in found]))
        return
    if not found:
        click.echo(f"no dllama workers found in {discover_timeout:g} s (a worker advertises itself unless it "
                   "listens on loopback or runs with --no-advertise)", err=True)
        return
    rows = [("NAME", "ADDRESS", "PROTO", "SECRET", "THREADS", "FREE MB", "VERSION", "USED BY --workers auto")]
    for ad in found:
        reason = ad.unusable_reason(secret)
        rows.append((ad.name, f"{ad.host}:{ad.port}", _text(ad.protocol), "yes" if ad.secret else "no",
                     _text(ad.threads), _text(None if ad.mem_available is None else ad.mem_available // 1_000_000),
                     ad.version or "?", "yes" if reason is None else f"no: {reason}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def _text(value) -> str:
    return "?" if value is None else str(value)
