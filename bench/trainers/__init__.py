"""Training loops that run out of memory on purpose, for the end-to-end tests and the GPU check."""
