"""The one-command demo and its bundled datasets."""
