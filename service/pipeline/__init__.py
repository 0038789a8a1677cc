"""The path a sample takes: read, decode, forecast (live state, phases, history), the rules
that decide alerts and the actions they call for, and what a batch commits."""
