"""Private ERM: output perturbation, the ERMG growing-database schedule, the release schedules."""
