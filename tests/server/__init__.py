"""Server tests (a package, so its conftest never shadows another folder's `conftest`)."""
