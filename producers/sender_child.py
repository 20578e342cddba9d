"""The sender process's entry point: ``python -m streamtally.producers.sender_child``.

A module of its own, imported by nothing, so that running it does not run a module
the package has already imported (`streamtally.producers.sender_process` is, by the
tap); see `streamtally.producers.sender_process` for what the process does.
"""

from streamtally.producers.sender_process import main

if __name__ == "__main__":
    main()
