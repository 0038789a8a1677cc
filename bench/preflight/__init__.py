"""The preflight zoo of ground-truth jobs, its accuracy runner, and the GPU check of preflight."""
