"""The command line (``objcomm bench``, ``objcomm launch``) and the benchmark; never imported by the library."""
