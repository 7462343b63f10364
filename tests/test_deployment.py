"""The deployment files (docker-compose.yml with the Dockerfiles' entry points, the systemd unit)
run commands the CLI accepts: every option they give exists and parses (Docker cannot run here)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dllama.cli import cli

ROOT = Path(__file__).resolve().parent.parent


def _entrypoint(dockerfile: str) -> list[str]:
    text = (ROOT / dockerfile).read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))


def _parses(argv: list[str]) -> None:
    """Parse argv as the `dllama` command line, without running it."""
    assert argv[0].endswith("dllama"), argv
    command = cli.get_command(None, argv[1])
    assert command is not None, f"no such command: {argv[1]}"
    command.make_context(argv[1], list(argv[2:]))


def _compose_commands():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, service in services.items():
        entry = _entrypoint(service["build"]["dockerfile"])
        yield name, entry + service["command"]


@pytest.mark.parametrize("name, argv", list(_compose_commands()), ids=lambda v: v if isinstance(v, str) else "")
def test_compose_services_run_valid_commands(name, argv):
    _parses(argv)


def test_compose_root_serves_the_page_and_finds_its_workers():
    commands = dict(_compose_commands())
    assert commands["root"][1] == "serve" and "auto" in commands["root"]
    assert "--no-advertise" not in commands["worker"]  # the workers advertise themselves
    assert "worker1:9998,worker2:9998,worker3:9998" in commands["root-fixed"]  # the fixed list still works


def test_every_compose_worker_has_a_memory_limit():
    """As a small board's RAM: the worker counts its container's limit in what it admits
    (tests/test_memory_limits.py)."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    workers = {name: s for name, s in services.items() if s["build"]["dockerfile"].startswith("worker/")}
    assert len(workers) == 4
    for name, service in workers.items():
        assert service["deploy"]["resources"]["limits"]["memory"] == "2g", name


def test_the_systemd_unit_starts_an_advertising_worker():
    unit = (ROOT / "worker" / "dllama-worker.service").read_text()
    argv = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))
    _parses(argv)
    assert argv[1] == "worker" and "--advertise" in argv
