"""Errors both planes and the command line share."""


class ConfigError(Exception):
    """Something the user gave is wrong: a flag's value, a model directory, a port in use. The
    `splitserve` command prints it as one line and exits EXIT_CODE, argparse's for its own."""

    EXIT_CODE = 2
