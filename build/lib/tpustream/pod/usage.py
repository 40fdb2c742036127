"""The argument parser every ``tpustream-pod`` command uses: a usage mistake is one line and exit 2."""

from __future__ import annotations

import argparse
from typing import NoReturn

from tpustream.errors import ConfigError


class UsageParser(argparse.ArgumentParser):
    """Usage mistakes become ConfigError, reported like every other error: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before the first ``--``, the command after it."""
    if "--" in argv:
        split = argv.index("--")
        return argv[:split], argv[split + 1 :]
    return argv, []
