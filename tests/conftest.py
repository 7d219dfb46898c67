from hypothesis import HealthCheck, settings

# No deadlines: the machines that run the suite are shared and their timing is noisy.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("default")
