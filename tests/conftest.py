import os

from hypothesis import HealthCheck, settings

# No deadlines: the machines that run the suite are shared and their timing is noisy.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
# CI draws the same examples every run, so that its verdict is the code's, not the draw's;
# local runs draw new examples each time and keep exploring.
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")
