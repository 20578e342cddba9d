"""Exceptions raised by streamtally.

    StreamtallyError
    ├── InputError               bad input: the caller or producer must fix it
    │   ├── InvalidEvent         one raw event is not of the named source
    │   └── NotAStream           a whole input holds no event of the named source
    └── StackError               the local Kafka/Redis stack cannot be managed

Everything raised for bad input is an `InputError`: the CLI turns it into a
message on stderr and exit status 2; the processors send the event to the
dead-letter topic with `str(exc)` as the reason.
"""

from __future__ import annotations

__all__ = ["InputError", "InvalidEvent", "NotAStream", "StackError", "StreamtallyError"]


class StreamtallyError(Exception):
    """Base of every streamtally exception."""


class InputError(StreamtallyError):
    """Input that cannot be normalised."""


class InvalidEvent(InputError):
    """A raw event that is not valid for its source."""


class NotAStream(InputError):
    """An input that holds no event of the named source at all."""


class StackError(StreamtallyError):
    """The local stack (Kafka, Redis) could not be started, stopped or reached."""
