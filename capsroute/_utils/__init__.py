"""Helpers of the command-line tools: argument parsing and refusals (command), what a record says
about its run (runinfo)."""
