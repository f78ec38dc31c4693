"""Adapters that reach into other projects' internals or depend on their versions. See README.md here."""
