"""Errors a person can act on.

Every failure caused by input (a path, a flag, a checkpoint, a request) is a
``PodsnapError`` whose message names the bad value and what would be valid.
The CLI prints the message without a traceback and exits with status 2.
"""


class PodsnapError(Exception):
    """Base class for errors whose message is meant for the operator."""


class CheckpointError(PodsnapError):
    """An HF checkpoint directory is missing, incomplete or inconsistent."""


class ConfigError(PodsnapError):
    """A configuration value (config.json field, CLI flag) is not supported."""
