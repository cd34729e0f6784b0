"""The command line (torch-free until a command runs).

Its commands, ``partc train``'s launcher and config, and the names a user picks among.
"""
