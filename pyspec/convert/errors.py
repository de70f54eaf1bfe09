"""The one exception the converter raises for anything the user can fix."""


class ConversionError(Exception):
    """A checkpoint, option or file the converter cannot turn into a GGUF; the message says why."""
