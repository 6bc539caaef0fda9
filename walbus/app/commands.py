"""Which config classes each command reads: for the configuration's typo check.

The core's ``load_config`` judges a config file's top-level keys against every command's
options; it may not import the services, so the application layer tells it
(:func:`register`, run by the CLI before a command reads its configuration).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Final

from walbus.config import set_command_catalog

# Every command's [table] of a config file and its config classes ("module:Class"), imported
# only to judge a top-level key this command does not take. A unit test checks that it names
# every class load_config reads.
COMMAND_CONFIGS: Final = {
    "produce": ("producer.config:ProducerConfig",),
    "demux": ("demux.config:DemuxConfig",),
    "warehouse": ("warehouse.cli:LoadConfig", "warehouse.cli:StreamConfig", "warehouse.cli:SqlConfig",
                  "warehouse.cli:PrepareConfig"),
    "status": ("walbus.app.status:StatusConfig",),
    "tail": ("walbus.app.tail:TailConfig",),
    "groups": ("walbus.app.groups:GroupsConfig",),
    "dead-letters": ("walbus.app.deadletters:DeadLettersConfig",),
}


def every_option_name() -> set[str]:
    """The option names of every command (underscored)."""
    names: set[str] = set()
    for specs in COMMAND_CONFIGS.values():
        for spec in specs:
            module, _, name = spec.partition(":")
            names |= {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    return names


def register() -> None:
    set_command_catalog(COMMAND_CONFIGS, every_option_name)
