"""Repository-wide pytest settings: hypothesis profiles (pick one with --hypothesis-profile), pytester."""

from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]  # the plugin's own tests run pytest inside pytest

# ci: derandomized and bounded for a 2-core machine; dev: more examples when hunting.
settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile("ci")
