"""The one error base the command line knows: what the user gave is wrong.

A `UsageError` (a store URL that does not open, a missing file or folder, an agent that cannot be
imported, a malformed task file or config) carries a message that names the problem; `lightning-mw`
prints it on one line and exits 2, with no traceback. Anything else is a bug, and keeps its traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """Something given by the user is wrong; the message says what and where."""
