def test_placeholder_import() -> None:
    import data_juicer  # noqa: F401
