"""The project's exceptions: each names the file, field or value at fault."""


class ActstoreError(Exception):
    """Base class for every error actstore raises on bad input or a bad store."""


class ConfigError(ActstoreError):
    """A config value is missing, misspelled, mistyped or inconsistent with the model/dataset."""


class FormatError(ActstoreError):
    """A store on disk does not match its format: missing/short file, bad field, bad checksum."""


class WriteInProgressError(ActstoreError):
    """Another process writes the same output now (a lab member's run on a shared dump_to)."""
