"""Embedded tasks and tiny models the adapters' main jobs and tests share (the README's layout table).

Import the submodules directly; this package imports nothing heavy.
"""
