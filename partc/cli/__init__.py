"""The command line (torch-free until a command runs): its commands, ``partc train``'s launcher and config, and the names a user picks among."""
