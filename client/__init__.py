"""Client library and the ``q6serve`` command line."""
