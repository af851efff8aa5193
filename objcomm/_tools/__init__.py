"""The command line (``objcomm bench``, ``objcomm serializers``, ``objcomm demo``), the launcher of local ranks
and the benchmark: never imported by the library."""
