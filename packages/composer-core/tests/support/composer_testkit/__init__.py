"""composer's test and bench support (never shipped: it lives in composer-core's ``tests/support``).

Every package's pytest finds it through ``pythonpath`` in its ``[tool.pytest.ini_options]``; a bench script
puts ``packages/composer-core/tests/support`` on ``sys.path`` itself. See CONTRIBUTING.md (Test support).

- :mod:`composer_testkit.teacher_server`: a deterministic chat-completions server on 127.0.0.1 with faults.
- :mod:`composer_testkit.env_server`: the digit-reversal OpenEnv server as a real process (needs openenv).
- :mod:`composer_testkit.faulty_env_server`: that server with a fault (slow, garbage, wrong schema).
- :mod:`composer_testkit.teacher_context`: the SDPO teacher-context case every adapter's suite runs.
- :mod:`composer_testkit.host_reads`: record aten operators to show a path reads nothing to the host.
- :mod:`composer_testkit.reference`: naive, fully materialised reference formulas.
- :mod:`composer_testkit.bench` / :mod:`composer_testkit.machine`: run a bench script at ``--small``; the CPU model.
"""
