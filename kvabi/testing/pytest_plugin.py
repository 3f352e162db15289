"""pytest plugin of the conformance kit (option --kvabi-backend)."""
