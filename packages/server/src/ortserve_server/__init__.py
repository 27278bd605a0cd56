"""ortserve package."""

__all__: list[str] = []
