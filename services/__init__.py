"""DARTree Serve back-end services: tree algorithms, drafter and verifier workers, wire protocol.

Importing this package imports nothing heavy; torch is imported only by the sub-packages that
need it (``services.tree``, ``services.drafter``, ``services.verifier``).
"""
