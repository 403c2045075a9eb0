"""The ``room-outbox`` command line (:mod:`.main`), one module per command group."""
