"""Workers announce themselves on the LAN by mDNS / DNS-SD (`_dllama._tcp`), and roots find them.

A worker's advertisement says where it listens and, in its TXT record, what a root needs to decide
before it dials: the protocol version, whether a secret guards it, its threads, the memory it can
take (refreshed while it runs) and a node name. python-zeroconf does the multicast DNS (probing,
conflicts, caches, goodbyes); this module only says what is advertised and how it is read.

Anyone on the LAN can advertise anything: every field is parsed defensively, bounded, and only
decides whether to try a worker; the handshake (version, secret) still decides whether to use it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from dataclasses import asdict, dataclass
from typing import Callable

from .frames import PROTOCOL_VERSION

log = logging.getLogger("dllama.discovery")

SERVICE_TYPE = "_dllama._tcp.local."
RESOLVE_TIMEOUT_MS = 3000  # how long one worker's SRV/TXT/A records may take to arrive
REFRESH_S = 30.0  # how often a worker re-announces the memory it can take, when that changed
MAX_FIELD = 64  # a TXT value longer than this (from whatever advertises on the LAN) is cut


@dataclass(frozen=True)
class WorkerAd:
    """One worker as its advertisement describes it. `host` is the address a root should dial."""

    name: str
    host: str
    port: int
    protocol: int | None
    secret: bool
    threads: int | None
    mem_available: int | None  # bytes the worker accepts for a slice and its KV cache
    version: str

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def unusable_reason(self, secret: str | None) -> str | None:
        """Why a root holding `secret` would not use this worker, or None if it would try it."""
        if self.protocol != PROTOCOL_VERSION:
            return f"speaks protocol version {self.protocol}, this node speaks {PROTOCOL_VERSION}"
        if self.secret and not secret:
            return "is protected by a secret (give --secret)"
        if not self.secret and secret:
            return "has no secret, and this node has one"
        return None

    def to_json(self) -> dict:
        return asdict(self)


def _text(properties: dict, key: str) -> str | None:
    value = properties.get(key.encode())
    if not isinstance(value, bytes):
        return None
    return value[:MAX_FIELD].decode("utf-8", "replace")


def _number(properties: dict, key: str) -> int | None:
    text = _text(properties, key)
    return int(text) if text is not None and text.isdigit() and len(text) <= 18 else None


def _local_networks() -> list:
    import ifaddr

    return [ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False)
            for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)]


def pick_address(addresses: list[str], networks: list) -> str | None:
    """The advertised address to dial: one on a network this node is on (a Pi may also advertise
    a docker bridge or a second interface the root cannot reach), else the first."""
    for text in addresses:
        if any(ipaddress.ip_address(text) in net for net in networks):
            return text
    return addresses[0] if addresses else None


def parse_ad(info, networks: list) -> WorkerAd | None:
    """A resolved zeroconf ServiceInfo as a WorkerAd; None when it has no address or port."""
    from zeroconf import IPVersion

    host = pick_address(info.parsed_addresses(IPVersion.V4Only), networks)
    if host is None or not info.port:
        return None
    props = info.properties or {}
    instance = info.name[:-len(SERVICE_TYPE) - 1] if info.name.endswith("." + SERVICE_TYPE) else info.name
    mem_mb = _number(props, "mem_mb")
    return WorkerAd(name=_text(props, "name") or instance[:MAX_FIELD], host=host, port=info.port,
                    protocol=_number(props, "proto"), secret=_text(props, "secret") == "1",
                    threads=_number(props, "threads"), mem_available=None if mem_mb is None else mem_mb * 1_000_000,
                    version=_text(props, "version") or "")


def advertised_addresses(host: str) -> list[str]:
    """The IPv4 addresses a worker listening on `host` is reachable at (all but loopback for a
    wildcard)."""
    if host not in ("", "0.0.0.0", "::"):
        return [host]
    import ifaddr

    return [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback]


class Advertiser:
    """Announces one worker as `<name>-<port>._dllama._tcp.local.` until closed (with a goodbye)."""

    def __init__(self, name: str, host: str, port: int, *, threads: int, secret: bool,
                 memory: Callable[[], int | None], version: str, protocol: int = PROTOCOL_VERSION):
        self.name, self.host, self.port = name, host, port
        self.threads, self.secret, self.memory, self.version, self.protocol = threads, secret, memory, version, protocol
        self._zc = None
        self._info = None
        self._mem_mb = None
        self._refresher: asyncio.Task | None = None

    def _properties(self) -> dict:
        mem = self.memory()
        self._mem_mb = None if mem is None else mem // 1_000_000
        props = {"proto": str(self.protocol), "secret": "1" if self.secret else "0", "threads": str(self.threads),
                 "name": self.name[:MAX_FIELD], "version": self.version}
        if self._mem_mb is not None:
            props["mem_mb"] = str(self._mem_mb)
        return props

    async def start(self) -> None:
        """Register (probing for a name conflict takes ~1 s, done in the background)."""
        from zeroconf import InterfaceChoice, IPVersion, ServiceInfo
        from zeroconf.asyncio import AsyncZeroconf

        addresses = advertised_addresses(self.host)
        if not addresses:
            log.warning("not advertised: this machine has no address other than loopback")
            return
        interfaces = InterfaceChoice.All if self.host in ("", "0.0.0.0", "::") else [self.host]
        self._zc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        # the host name is this worker's own: namespaces or containers on one machine share a hostname,
        # and one name for several addresses would merge their A records in every root's cache
        server = f"dllama-{os.urandom(4).hex()}.local."
        self._info = ServiceInfo(SERVICE_TYPE, f"{self.name[:40]}-{self.port}.{SERVICE_TYPE}", port=self.port,
                                 parsed_addresses=addresses, properties=self._properties(), server=server)
        self._refresher = asyncio.ensure_future(self._register_and_refresh())

    async def _register_and_refresh(self) -> None:
        try:
            await (await self._zc.async_register_service(self._info, allow_name_change=True))
            log.info("advertised as %r on %s", self._info.name, ", ".join(self._info.parsed_addresses()))
            while True:
                await asyncio.sleep(REFRESH_S)
                before = self._mem_mb
                properties = self._properties()
                if before is None or self._mem_mb is None or abs(self._mem_mb - before) > max(before // 20, 16):
                    self._info.properties = properties  # noqa: the setter re-encodes the TXT record
                    await (await self._zc.async_update_service(self._info))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker serves roots that know its address all the same
            log.warning("mDNS advertising stopped: %s", e)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self._zc is not None:
            try:
                await (await self._zc.async_unregister_service(self._info))
            except Exception:  # never registered (closed during probing), or the network went away
                pass
            await self._zc.async_close()
            self._zc = None


class Browser:
    """Keeps the set of `_dllama._tcp` workers visible on the LAN up to date while it runs."""

    def __init__(self):
        self._zc = None
        self._browser = None
        self._ads: dict[str, WorkerAd] = {}
        self._tasks: set[asyncio.Task] = set()
        self._networks: list = []

    async def start(self) -> "Browser":
        from zeroconf import InterfaceChoice, IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        self._networks = _local_networks()
        self._zc = AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        return self

    def _on_change(self, zeroconf, service_type, name, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            self._ads.pop(name, None)
            return
        task = asyncio.ensure_future(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
                return
            ad = parse_ad(info, self._networks)
        except (ValueError, UnicodeError) as e:  # a malformed record from something on the LAN
            log.info("ignored the advertisement %r: %s", name, e)
            return
        if ad is not None:
            self._ads[name] = ad

    def found(self) -> list[WorkerAd]:
        """What is visible now, by name then address. (A root's compute thread asks too: copying the
        values out of the dict is atomic under the GIL.)"""
        return sorted(self._ads.values(), key=lambda ad: (ad.name, ad.host, ad.port))

    def usable(self, secret: str | None) -> list[WorkerAd]:
        """What a root holding `secret` would try (the handshake has the last word)."""
        return [ad for ad in self.found() if ad.unusable_reason(secret) is None]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._zc is not None:
            await self._zc.async_close()
            self._zc = None


async def discover(timeout: float) -> list[WorkerAd]:
    """The workers that answer within `timeout` seconds."""
    browser = await Browser().start()
    try:
        await asyncio.sleep(timeout)
        return browser.found()
    finally:
        await browser.close()
