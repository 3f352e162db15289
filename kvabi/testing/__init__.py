"""Conformance kit for kvabi backends."""
