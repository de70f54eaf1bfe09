"""Reading GGUF files with the gguf package, in one place: opening one with a clear error (the
reader raises plain ValueErrors and struct errors on a damaged file) and a metadata key's value."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Type, Union

import gguf


def open_gguf(path: Union[str, Path], what: str = "GGUF", error: Type[Exception] = ValueError
              ) -> gguf.GGUFReader:
    """The reader of `path`; `error`("cannot read {what} {path}: ...") when it is not readable."""
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise error(f"cannot read {what} {path}: {e}") from None


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata key `key` (arrays as lists), or `default` when it is absent."""
    field = reader.fields.get(key)
    return field.contents() if field is not None else default
