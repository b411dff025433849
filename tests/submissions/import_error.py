"""Bad submission: imports a module that does not exist (every rank fails at once)."""

import lab_utils.no_such_module_fixture_ie  # noqa: F401

print("never printed")
