"""GGUF files from the Hugging Face Hub, as llama.cpp's `-hf user/model[:quant]` resolves them:
the file whose name carries the quant tag (default Q4_K_M), else the first GGUF of the repository;
`-hff FILE` names the file outright. Files land in huggingface_hub's user cache, so a second run
(or `--offline`) finds them without the network.
"""

from __future__ import annotations

import re
from typing import List, Optional

DEFAULT_QUANT = "Q4_K_M"


class HubError(ValueError):
    """A repository or file that cannot be had, with the reason and what to do."""


def split_repo(spec: str):
    """'user/model[:quant]' -> (repo, quant or None)."""
    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"invalid Hugging Face repository '{spec}': expected user/model[:quant]")
    return repo, (quant or None)


def pick_gguf(files: List[str], quant: Optional[str]) -> str:
    """The GGUF llama.cpp would take from a repository's file list (split files: part 1)."""
    def later_part(f: str) -> bool:
        m = re.search(r"-(\d+)-of-\d+\.gguf$", f)
        return bool(m) and int(m.group(1)) > 1

    ggufs = [f for f in files if f.lower().endswith(".gguf") and not later_part(f)
             and "mmproj" not in f.lower()]
    if not ggufs:
        raise HubError("the repository has no GGUF file")
    tag = (quant or DEFAULT_QUANT).lower()
    tagged = [f for f in ggufs if re.search(rf"(?:^|[-_.]){re.escape(tag)}(?:[-_.]|$)",
                                            f.rsplit("/", 1)[-1].lower())]
    if tagged:
        return sorted(tagged)[0]
    if quant:
        raise HubError(f"no GGUF file for quant '{quant}' (files: {', '.join(sorted(ggufs))})")
    return sorted(ggufs)[0]


def download_gguf(spec: str, filename: Optional[str] = None, token: Optional[str] = None,
                  offline: bool = False) -> str:
    """The local path of the repository's GGUF, downloaded into the user cache if needed.
    Raises HubError naming the repository when it cannot be had (offline, missing, no access)."""
    try:
        from huggingface_hub import hf_hub_download, list_repo_files
        from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError:  # pragma: no cover - a dependency of pyspec
        raise HubError("huggingface_hub is not installed: pip install huggingface_hub") from None
    repo, quant = split_repo(spec)
    try:
        if filename is None:
            if offline:
                raise HubError(f"cannot pick a file of '{repo}' offline: give it with -hff")
            filename = pick_gguf(list_repo_files(repo, token=token), quant)
        return hf_hub_download(repo, filename, token=token, local_files_only=offline)
    except HubError as exc:
        raise HubError(f"Hugging Face repository '{repo}': {exc}") from None
    except LocalEntryNotFoundError:
        raise HubError(f"cannot download from Hugging Face repository '{repo}': the network is "
                       "unreachable (or --offline is set) and the file is not in the local cache "
                       "(give a local file with -m)") from None
    except RepositoryNotFoundError:
        raise HubError(f"Hugging Face repository '{repo}' does not exist or needs a token "
                       "(-hft / HF_TOKEN)") from None
    except EntryNotFoundError:
        raise HubError(f"Hugging Face repository '{repo}' has no file '{filename}'") from None
    except Exception as exc:  # connection errors come in many types
        raise HubError(f"cannot download from Hugging Face repository '{repo}': "
                       f"{type(exc).__name__}: {exc}") from None
