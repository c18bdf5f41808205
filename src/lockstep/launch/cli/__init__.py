"""`lockstep run`'s command line: its flags, turned into one validated `RunConfig`."""
