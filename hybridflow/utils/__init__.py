"""Small shared helpers with no dependency on the rest of the package."""
