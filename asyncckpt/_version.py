"""The library version, also written into every manifest."""

__version__ = "0.1.0"
