"""actstore: extract transformer activations once, store them losslessly in five formats."""

__version__ = "0.1.0"
