"""Stop strings in streamed text, shared by `LLM.generate` and the server's slots."""

from __future__ import annotations

from typing import List, Tuple


def stop_list(stop) -> List[str]:
    """None, a string or a list of strings -> the non-empty stop strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop strings must be strings, got {type(s).__name__}")
        if s:
            out.append(s)
    return out


class StopMatcher:
    """Finds stop strings in streamed text. Text that might be the start of a stop string is held
    back until the next piece shows whether it is."""

    def __init__(self, stops: List[str]):
        self.stops = stops
        self.held = ""
        self.matched = ""  # the stop string found ("" while none)

    def feed(self, text: str) -> Tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). On a match the text
        ends just before the earliest stop string, and `matched` names it."""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf, False
        found = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            at, self.matched = min(found, key=lambda f: f[0])
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def finish(self) -> str:
        out, self.held = self.held, ""
        return out
