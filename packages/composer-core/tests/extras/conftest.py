"""Session setup for tests/extras.

hypothesis is imported here, up front: its pytest plugin otherwise imports it lazily in the terminal summary,
where pytest's assertion rewriter compiles its modules. On CPython < 3.11.8 the AST validator's recursion
counter is process-global, not per thread (gh-106905); a background thread of a test here that compiles
source at the same moment can leave it off by some frames, and that late compile then fails with
"SystemError: AST constructor recursion depth mismatch" after every test passed (seen once in CI).
"""

import hypothesis  # noqa: F401
