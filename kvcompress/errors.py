"""Exceptions raised by kvcompress. Every message names the problem and the valid choices."""

__all__ = ["KVCompressError", "ConfigError", "PluginError", "CompositionError"]


class KVCompressError(Exception):
    """Base class of every kvcompress error."""


class ConfigError(KVCompressError, ValueError):
    """A configuration value is invalid: the message names the field, the value and the choices."""


class PluginError(KVCompressError):
    """A plugin failed to load, or two plugins claim the same component name."""


class CompositionError(ConfigError):
    """Components that cannot work together were composed into a method."""
