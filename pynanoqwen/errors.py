"""The one exception type that user-caused problems raise.

Anything a user can get wrong (a bad file, a bad flag, a prompt too long, a checkpoint we do not
support) raises `NanoQwenError` or a subclass; the CLI turns it into a one-line message and a
non-zero exit code. Any other exception escaping is a bug in pynanoqwen.
"""


class NanoQwenError(Exception):
    """A problem the user can fix, described in one line."""


class FormatError(NanoQwenError):
    """A .nanoqwen file is malformed: bad magic, version, checksum, offset, length or shape."""


class ConfigError(NanoQwenError):
    """A model config we cannot run (unsupported architecture, rope scaling, sizes)."""


class CheckpointError(NanoQwenError):
    """A Hugging Face checkpoint directory is incomplete or holds tensors we cannot convert."""
